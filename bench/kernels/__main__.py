"""`python -m bench.kernels`: the kernel benchmark suite of bench/kernels/suite.py."""

from bench.kernels.suite import main

main()

"""`python -m bench.hisparse`: the HiSparse decode benchmark of bench/hisparse/decode.py."""

import sys

from bench.hisparse.decode import main

main(sys.argv[1:])

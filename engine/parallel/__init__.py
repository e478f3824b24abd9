"""Context, expert and data parallelism of one engine over N ranks (docs/parallelism.md, docs/dp_ep.md).

    executor.py    MultiRankEngineCore: EngineCore's interface, rank 0 = the caller's process
    spawn.py       spawns ranks 1..N-1 (torchrun's environment), RankPool (idle ranks reused), torchrun entry point
    worker.py      a worker rank's loop
    dist.py        process groups, collectives with byte counters
    cp_runner.py   CPModelRunner: own rows, DCP write mapping, EP experts, gathered outputs
    step.py        the plan of one forward pass (PCP rows, prefill vs decode attention path)
    pcp.py         DualChunkSwap split of query rows
    dcp.py         token -> (rank, local index) arithmetic, LSE merges (ag_rs, a2a), global top-k
    dcp_context.py DCP prefill path: per-layer context all-gather into a temporary buffer (+ prefetch)
    dcp_decode.py  DCP decode path: sharded indexer + attention, exact merge
    cp_backend.py  the attention backend wrapper the model calls
    ep.py          MoE all-to-all dispatcher
    dp.py          DPEngineCore: a DP x EP decode group (a scheduler per rank, imports on a chosen rank)
    dp_runner.py   DPModelRunner: a DP rank's runner, lock-step rounds, dummy MoE passes
"""

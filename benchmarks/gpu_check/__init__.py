"""bunsan's GPU self-check (`bash scripts/gpu-check`, project issue #19 section 3).

One command on a lent GPU machine checks what every CPU/gloo figure cannot: bunsan's layouts on CUDA against a
CPU fp32 run, two ranks sharing one GPU through gloo against a one-process GPU run, host syncs per step under a
one-rank NCCL group, 1B-parameter throughput and MFU next to torch's own loop, measured memory against
`bunsan estimate`, `bunsan generate --device-map` / `bunsan serve` on the GPU, and the kernels the planner prices
(GEMMs by shape, flash attention by length, element-wise passes) with compiled recompute's memory. `--dry-run`
runs the same code on the CPU at tiny sizes, so the script is proven end to end by the test suite between GPU
runs.

Each group of rows (a section) runs in its own process with a time budget: a hang or a crash costs that
section's rows (recorded as failed, with why), never the rest of the run or the machine's lease. A dry run has
no budget (it must run every row, however loaded the machine): only a hung section is killed.
"""

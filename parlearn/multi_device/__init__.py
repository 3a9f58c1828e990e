"""Part 1 · training on many devices (lessons 11-19), on real engines.

- ``data_parallel``: naive and bucketed DP beside DDP, compression, stragglers (lesson 11);
- ``sharding``: weight-update sharding and ZeRO 1-3 beside FSDP2 and JAX (lesson 12);
- ``pipeline``: GPipe, 1F1B, zero-bubble, interleaved, ZB-V and DualPipe-V schedules on real
  ranks, simulator (lesson 13);
- ``tensor_parallel``: Megatron layers, adjoint movements, tiling plans (lesson 14);
- ``batching``: the noise scale, SimiGrad, AdaScale (lesson 15);
- ``transformer``: the tiny GPT every later lesson of Part 1 splits (lesson 16);
- ``memory``: the memory ledger of a step, recomputation, mixed precision, a calculator
  (lesson 16);
- ``context_parallel``: sequence parallelism, Ulysses, ring attention, zig-zag (lesson 17);
- ``moe``: routing, capacity, load balance, expert parallelism by all-to-all (lesson 18).
"""

"""weightserve benchmarks: ``python -m bench --size-gib 2`` (``--quick`` for CI).

One run measures the ceilings (raw loopback TCP, page cache), the alternative users pick
today (the file on a static web server, loaded with safetensors) and weightserve (HTTP and
gRPC; whole model, prefix, shard, concurrent clients, small requests, memory), alternating
contenders over rounds, and prints ratios to the ceilings. Results go to
``bench/results/local/latest.json`` (not tracked); ``WEIGHTSERVE_BENCH_RECORD=1`` writes
``bench/results/`` instead, the results ``docs/performance.md`` quotes.

Modules: ``checkpoint`` (the cached test checkpoint), ``procs`` (server and worker
processes), ``worker`` (one measured client), ``ceilings``, ``webserver``, ``server`` and
``weightserve_loads`` (the contenders), ``report`` (stats, goals, table), ``run`` (the
orchestration), ``profile`` (py-spy profiles of the whole-model loads).

``python -m bench --against REF`` (``ab``, servers from ``ab_server``) runs the HTTP loads
against this tree's server and REF's alternately and prints the ratios this/REF.

``python -m bench.scaling`` (``scaling``) measures how the one-process server's bulk path
grows with concurrent clients and cores against raw streams, and the share of its CPU that
holds the GIL (perf), at 1, 2, 4, 8 clients (``bench/results/scaling.json``).

``python -m bench.fill`` measures cold fills of the node cache from a loopback S3 server
(``s3``: SeaweedFS) against ``pyarrow.fs.copy_files`` of the same objects
(``bench/results/fill-latest.json``).
"""

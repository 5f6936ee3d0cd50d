"""The benchmarks: scripts run as ``python bench/bench_X.py`` (each prints a readable table, then
one JSON object as its last line), and the modules they share.

A script imports the shared modules by their plain names (the script's folder is first on
``sys.path``) and never another script: ``harness`` (the machine line, rounds in alternating
order, medians, tables, the JSON last line), ``workloads`` (the prompts, decode rate and replay
model several benches measure with), ``make_llama`` (model and adapter files), ``peer_setup``,
``llamacpp_peer``, ``lorapage_peer``, ``peer_proc`` and ``peer_sweep`` (the peer benchmarks'
set-up, their engines' worker processes and the llama.cpp sweep's bookkeeping),
``soak_isolation`` and ``soak_size`` (the soak's attacks of issue 38).
"""

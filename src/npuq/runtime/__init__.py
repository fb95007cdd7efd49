"""Running the static graphs: the KV-cache runner, the float workloads the thread tuner times,
and text generation.

    runner.py      StaticRunner (prefill chunks, decode steps, cache writes) over any graph callable
    workloads.py   one float forward of each phase, as a thread-tuner Workload
    generate.py    greedy generation through prefill and decode graphs
"""

"""Helpers for the tests and benchmarks, not used by npuq itself (tests/test_layering.py checks
that no other module of npuq imports this package).

    tiny.py        tiny random models built from real Hugging Face configs, one per family
    transfer.py    align two prepared graphs and copy observer state between them (the reference
                   the one-graph calibration is tested against)
"""

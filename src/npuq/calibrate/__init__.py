"""Calibration: windows of real tokens, the one-pass and sequential engines, and the encodings
they produce.

    split.py       split a token stream into whole windows and an unpadded tail
    graphs.py      export the calibrate (dynamic), prefill and decode graphs
    engines.py     calibrate_onepass (whole windows) and calibrate_sequential (AR-1 decode)
    encodings.py   per-tensor encodings (AIMET/QNN layout) and the KV input/output check
"""

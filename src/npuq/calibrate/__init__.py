"""Calibration: windows of real tokens, the one-pass and sequential engines, carrying observer
state between graphs of one model, and the encodings it produces.

    split.py       split a token stream into whole windows and an unpadded tail
    graphs.py      export the calibrate (dynamic), prefill and decode graphs
    engines.py     calibrate_onepass (whole windows) and calibrate_sequential (AR-1 decode)
    transfer.py    align two prepared graphs and copy observer state between them
    encodings.py   per-tensor encodings (AIMET/QNN layout) and the KV input/output check
"""

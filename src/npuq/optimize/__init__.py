"""Accuracy recovery: pure searches over one layer at a time, and their driver over a model.

    seqmse.py      SeqMSE: candidate weight scales searched per channel (or per layer), vectorised
    gptq.py        GPTQ rounding with error compensation (act-order)
    driver.py      Gram collection (float or partly quantized layer inputs), search, rounding
    recovery.py    under a recipe: which layers, the options checked together, the scales to pin
"""

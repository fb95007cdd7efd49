"""HTP numeric formats on PT2E: formats and recipes as data, observers and the quantizer.

    schemes.py     TensorFormat, granularities, the SCHEMES table (16a16w ... 8a8w)
    recipe.py      Rule, Recipe, RecipePlan.summary(), built-in and per-model default recipes
    observers.py   min/max observers that name the tensor on NaN/Inf; LPBQ per-block weights
    specs.py       TensorFormat → PT2E QuantizationSpec
    graph.py       module paths, op kinds and KV structure of the exported decoder graph
    quantizer.py   HtpQuantizer (torchao PT2E Quantizer)

The quantize stage that uses them (prepare, calibrate, convert, save) is npuq.quantize.
Submodules are imported on use (torchao is slow to import).
"""

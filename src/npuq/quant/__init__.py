"""Quantization for the HTP: formats and recipes as data, observers, the PT2E quantizer, the
quantize pipeline and its artifact.

    schemes.py     TensorFormat, granularities, the SCHEMES table (16a16w ... 8a8w)
    recipe.py      Rule, Recipe, RecipePlan.summary(), built-in and per-model default recipes
    observers.py   min/max observers that name the tensor on NaN/Inf; LPBQ per-block weights
    specs.py       TensorFormat → PT2E QuantizationSpec
    graph.py       module paths, op kinds and KV structure of the exported decoder graph
    quantizer.py   HtpQuantizer (torchao PT2E Quantizer)
    pipeline.py    quantize_model → QuantizedModel (decode + prefill programs, .logits)
    artifact.py    save_artifact / load_artifact
    run.py         quantize_to_artifact, the ``npuq quantize`` workflow

Submodules are imported on use (torchao is slow to import).
"""

"""The quantize stage: model → calibrated (and recovered) decode + prefill programs → artifact.

    pt2e.py        quantize_model: export → prepare → calibrate → carry encodings → convert
    passes.py      graph passes over converted programs: convert's folding, specialize, Q/DQ clean-up
    artifact.py    save_artifact / load_artifact / read_artifact: the artifact folder
    stage.py       quantize_to_artifact, what ``npuq quantize`` and ``npuq run`` call
"""

"""Recipes: rules by op kind / module path with priorities, options, strict loading, summary."""

import json

import pytest

from npuq.errors import NpuqError
from npuq.quant.recipe import RECIPES, Recipe, Rotation, Rule, default_recipe, load_recipe
from npuq.quant.schemes import UINT8_SYM

LAYERS = [
    ("embed_tokens", "embedding"),
    ("layers.0.self_attn.q_proj", "linear"),
    ("layers.0.self_attn", "matmul"),
    ("layers.0.mlp.down_proj", "linear"),
    ("layers.1.mlp.down_proj", "linear"),
    ("layers.10.mlp.down_proj", "linear"),
    ("lm_head", "linear"),
]


def test_priority_then_order_decides():
    r = Recipe("16a4w", (
        Rule("16a8w", op="linear", path=r"layers\.\d+\.mlp\.down_proj"),
        Rule("16a16w", path=r"layers\.1\.mlp\.down_proj", priority=5),
        Rule("8a8w", op="linear", path=r"layers\.\d+\.mlp\.down_proj"),  # same priority, later: loses
    ))
    scheme, label = r.resolve("layers.0.mlp.down_proj", "linear")
    assert (scheme.name, label) == ("16a8w", "rule 0")
    assert r.resolve("layers.1.mlp.down_proj", "linear")[0].name == "16a16w"
    # fullmatch: "layers.1" must not match "layers.10"
    assert r.resolve("layers.10.mlp.down_proj", "linear")[1] == "rule 0"
    assert r.resolve("layers.0.self_attn.q_proj", "linear") == (r.scheme, "default")


def test_lm_head_option_beats_rules():
    r = Recipe("16a4w", (Rule("8a8w", op="linear", priority=100),), lm_head="16a8w")
    assert r.resolve("lm_head", "linear")[0].name == "16a8w"
    assert r.resolve("layers.0.self_attn.q_proj", "linear")[0].name == "8a8w"


def test_rule_matching_nothing_is_an_error_that_says_so():
    r = Recipe("16a8w", (Rule("16a4w", op="linear", path=r"layers\.\d+\.mlp\.down_projection"),))
    with pytest.raises(NpuqError, match=r"rule 0 .*down_projection.* matches no layer of this model"):
        r.plan(LAYERS)


def test_summary_lists_every_layer_and_its_rule():
    plan = RECIPES["16a4w_mixed"].plan(LAYERS)
    text = plan.summary()
    for path, kind in LAYERS:
        assert path in text
    rows = {(a.path, a.kind): (a.rule, a.scheme) for a in plan.layers}
    assert rows[("layers.0.mlp.down_proj", "linear")] == ("rule 0", "16a8w")
    assert rows[("lm_head", "linear")] == ("option lm_head", "16a8w")
    assert rows[("layers.0.self_attn.q_proj", "linear")] == ("default", "16a4w")


def test_block_mixed_is_mixed_with_lpbq_for_the_4bit_layers():
    block, mixed = RECIPES["16a4w_block_mixed"].plan(LAYERS), RECIPES["16a4w_mixed"].plan(LAYERS)
    for a, b in zip(block.layers, mixed.layers, strict=True):
        assert (a.path, a.kind, a.rule) == (b.path, b.kind, b.rule)
        assert a.scheme == ("16a4w_block" if b.scheme == "16a4w" else b.scheme), a


@pytest.mark.parametrize("kwargs, message", [
    (dict(default="16a8w", kv_bits=4), "kv_bits must be 8 or 16"),
    (dict(default="8a8w", kv_bits=16), "exceeds the 8-bit activations"),
    (dict(default="16a8w", embedding="pcq2"), "embedding 'pcq2' is unknown"),
    (dict(default="16a9w"), "unknown scheme"),
    (dict(default="16a8w", lm_head="nope"), "unknown scheme"),
    (dict(default="16a4w", rotate="hadamard"), "rotate 'hadamard' is unknown; choose one of r1, r1\\+r2"),
])
def test_bad_options(kwargs, message):
    with pytest.raises(NpuqError, match=message):
        Recipe(**kwargs)


@pytest.mark.parametrize("rule, message", [
    (dict(scheme="16a8w"), "neither 'op' nor 'path'"),
    (dict(scheme="16a8w", op="conv"), "not an op kind"),
    (dict(scheme="16a8w", path="layers.(("), "not a valid regular expression"),
])
def test_bad_rules(rule, message):
    with pytest.raises(NpuqError, match=message):
        Rule(**rule)


def test_json_recipe_round_trip_and_strict_keys(tmp_path):
    r = RECIPES["16a4w_mixed"]
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(r.to_dict()))
    loaded = load_recipe(str(path))
    assert loaded.rules == r.rules and loaded.lm_head == r.lm_head and loaded.default == r.default
    assert loaded.rotate == r.rotate
    path.write_text(json.dumps({**r.to_dict(), "rotate": "r1+r2"}))
    assert load_recipe(str(path)).rotate == "r1+r2"
    bad = tmp_path / "typo.json"
    bad.write_text(json.dumps({"default": "16a8w", "rulez": []}))
    with pytest.raises(NpuqError, match="unknown key.*rulez"):
        load_recipe(str(bad))
    bad.write_text(json.dumps({"default": "16a8w", "rules": [{"path": "lm_head", "schema": "16a4w"}]}))
    with pytest.raises(NpuqError, match="unknown key.*schema"):
        load_recipe(str(bad))
    with pytest.raises(NpuqError, match="neither a built-in recipe"):
        load_recipe(str(tmp_path / "missing.json"))


def test_scheme_flag_replaces_the_default():
    # one default for every model, by name or path: 16a8w with R1 (rotate_model itself skips R1
    # where it would not be exact, tests/optimize/test_rotate.py)
    assert load_recipe(None, None) is default_recipe() is RECIPES["16a8w"]
    assert default_recipe().default == "16a8w" and default_recipe().rotate == "r1"
    assert load_recipe(None, "16a8w") is default_recipe()
    assert load_recipe(None, "16a4w").default == "16a4w"
    mixed = load_recipe("16a4w_mixed", "16a16w")
    assert mixed.default == "16a16w" and mixed.rules == RECIPES["16a4w_mixed"].rules
    with pytest.raises(NpuqError, match="unknown scheme"):
        load_recipe(None, "3a3w")


def test_rotate_flag_is_settled_in_the_recipe():
    """--rotate replaces the recipe's own rotation in load_recipe, the one place both meet; the
    stages read Recipe.rotation of the recipe it returns."""
    assert load_recipe(None).rotation == Rotation(r1=True) and RECIPES["16a16w"].rotation == Rotation(r1=True)
    assert RECIPES["8a8w"].rotation is None
    assert load_recipe(None, rotate="none").rotation is None
    assert load_recipe(None, rotate="none").name == "16a8w+norotate"
    assert load_recipe("16a4w_mixed", "16a8w", "r1+r2").rotation == Rotation(r1=True, r2=True)
    assert load_recipe("16a4w_mixed", "16a8w", "r1+r2").name == "16a4w_mixed@16a8w+r1+r2"
    assert load_recipe(None, "16a8w", "r1") is default_recipe()  # the recipe's own: unchanged, not renamed
    with pytest.raises(NpuqError, match="unknown --rotate"):
        load_recipe(None, rotate="r2")


def test_kv_cache_format_and_new_formats_keep_it():
    assert Recipe("16a8w", kv_bits=8).kv_format == UINT8_SYM and Recipe("8a8w").kv_format == UINT8_SYM
    assert Recipe("16a8w").kv_format is None
    # a cache narrower than the activations travels to other formats; one as wide follows them
    assert Recipe("16a8w", kv_bits=8, rotate="r1").with_formats("16a4w").kv_format == UINT8_SYM
    assert Recipe("16a8w", kv_bits=8, rotate="r1").with_formats("16a4w").rotation == Rotation(r1=True)
    assert Recipe("16a8w").with_formats("8a8w").to_dict() == Recipe("8a8w").to_dict()

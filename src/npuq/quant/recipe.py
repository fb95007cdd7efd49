"""Recipes: which scheme each layer gets, as data.

A recipe is a default scheme, an ordered list of rules and a few options:

    rule      op kind and/or module-path regex → scheme, with a priority
    options   kv_bits (8 | 16), embedding (shared | pcq8 | pcq4), lm_head (a scheme or None),
              rotate (None | "r1" | "r1+r2": rotations folded into the float weights before
              calibration, npuq.optimize.rotate; ``--rotate`` replaces it in :func:`load_recipe`)

A "layer" is one (module path, op kind) pair of the exported graph; module paths come from
``node.meta["nn_module_stack"]`` and read like the checkpoint (``layers.3.mlp.down_proj``).
The highest-priority matching rule wins (ties: the earlier rule); the ``lm_head`` option is a
rule above all others for the lm head; layers no rule matches take the default. A rule that
matches no layer of the model is an error: it is almost always a typo in the regex.

Recipes load from a built-in name (:data:`RECIPES`) or a JSON file whose keys are checked
(an unknown key fails loudly instead of being ignored)::

    {"default": "16a4w", "kv_bits": 16, "embedding": "shared", "lm_head": "16a8w", "rotate": "r1",
     "rules": [{"path": "layers\\\\.\\\\d+\\\\.mlp\\\\.down_proj", "scheme": "16a8w", "priority": 1}]}
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Sequence

from npuq.errors import NpuqError
from npuq.fsio import read_json
from npuq.quant.schemes import SCHEMES, UINT8_SYM, Scheme, TensorFormat, get_scheme

# Op kinds the quantizer assigns to graph nodes (see npuq.quant.quantizer).
OP_KINDS = (
    "embedding",  # token-table gather
    "linear",  # weight × activation (projections, lm head)
    "matmul",  # activation × activation (Q·Kᵀ, P·V)
    "norm",  # RMSNorm as one backend op
    "softmax",
    "act_fn",  # silu, gelu, sigmoid, tanh
    "elementwise",  # add, mul, neg, sub, div, rsqrt, pow, mean
    "concat",
    "rope_table",  # gather from the cos/sin tables
)
EMBEDDING_MODES = ("shared", "pcq8", "pcq4")
LM_HEAD_PATH = "lm_head"


@dataclass(frozen=True)
class Rotation:
    """Rotations folded into the float weights before calibration: R1 on the residual stream,
    R2 per attention head between v and o (npuq.optimize.rotate.rotate_model's ``r1``, ``r2``)."""

    r1: bool
    r2: bool = False


ROTATIONS = {"r1": Rotation(r1=True), "r1+r2": Rotation(r1=True, r2=True)}  # a recipe's "rotate" → its Rotation
ROTATE_CHOICES = ("none", *ROTATIONS)  # --rotate


@dataclass(frozen=True)
class Rule:
    scheme: str
    op: str | None = None  # one of OP_KINDS
    path: str | None = None  # regex matched against the whole module path (re.fullmatch)
    priority: int = 0

    def __post_init__(self) -> None:
        get_scheme(self.scheme)
        if self.op is None and self.path is None:
            raise NpuqError(f"recipe rule → {self.scheme} has neither 'op' nor 'path': give at least one")
        if self.op is not None and self.op not in OP_KINDS:
            raise NpuqError(f"recipe rule op {self.op!r} is not an op kind; choose one of {', '.join(OP_KINDS)}")
        if self.path is not None:
            if not isinstance(self.path, str):
                raise NpuqError(f"recipe rule path must be a regular expression string, got {self.path!r:.60}")
            try:
                re.compile(self.path)
            except re.error as exc:
                raise NpuqError(f"recipe rule path {self.path!r} is not a valid regular expression: {exc}") from None
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise NpuqError(f"recipe rule priority must be a whole number, got {self.priority!r}")

    def matches(self, path: str, kind: str) -> bool:
        return (self.op is None or self.op == kind) and (self.path is None or re.fullmatch(self.path, path) is not None)

    def describe(self) -> str:
        what = " ".join(x for x in (f"op={self.op}" if self.op else "", f"path={self.path}" if self.path else "") if x)
        return f"{what} → {self.scheme} (priority {self.priority})"


@dataclass(frozen=True)
class Recipe:
    default: str
    rules: tuple[Rule, ...] = ()
    kv_bits: int | None = None  # None: the default scheme's activation bits
    embedding: str = "shared"
    lm_head: str | None = None  # scheme of the lm head; None: rules decide
    name: str = ""
    rotate: str | None = None  # a ROTATIONS key: fold rotations into the weights first; None: none

    def __post_init__(self) -> None:
        get_scheme(self.default)
        object.__setattr__(self, "rules", tuple(self.rules))
        for r in self.rules:
            if not isinstance(r, Rule):
                raise TypeError(f"recipe rules must be Rule objects, got {r!r}")
        if self.lm_head is not None:
            get_scheme(self.lm_head)
        if self.rotate is not None and self.rotate not in ROTATIONS:
            raise NpuqError(f"recipe rotate {self.rotate!r} is unknown; choose one of {', '.join(ROTATIONS)} or null")
        if self.embedding not in EMBEDDING_MODES:
            raise NpuqError(f"recipe embedding {self.embedding!r} is unknown; choose one of {', '.join(EMBEDDING_MODES)}")
        act_bits = get_scheme(self.default).activation.bits
        if self.kv_bits is None:
            object.__setattr__(self, "kv_bits", act_bits)
        if self.kv_bits not in (8, 16):
            raise NpuqError(f"recipe kv_bits must be 8 or 16, got {self.kv_bits!r}")
        if self.kv_bits > act_bits:
            raise NpuqError(
                f"recipe kv_bits {self.kv_bits} exceeds the {act_bits}-bit activations of {self.default}: "
                f"use kv_bits {act_bits} or a 16-bit activation scheme"
            )
        if not self.name:
            object.__setattr__(self, "name", self.default)

    @property
    def scheme(self) -> Scheme:
        return get_scheme(self.default)

    @property
    def rotation(self) -> Rotation | None:
        """The rotations to fold into the weights before calibration; None: none. Settled once, by
        :func:`load_recipe` (the recipe's own or ``--rotate``'s): the stages read only this."""
        return None if self.rotate is None else ROTATIONS[self.rotate]

    @property
    def kv_format(self) -> TensorFormat | None:
        """The format of the KV cache's codes where the recipe narrows it below the ops' own
        activations: uint8 symmetric with an 8-bit cache (the K/V path is requantized to it,
        npuq.quant.quantizer); None with a 16-bit one (each op's own activation format)."""
        return UINT8_SYM if self.kv_bits == 8 else None

    def with_formats(self, default: str, rules: Sequence[Rule] = (), embedding: str = "shared",
                     lm_head: str | None = None, name: str = "") -> "Recipe":
        """Other formats (default scheme, rules, embedding, lm head) with this recipe's KV cache and
        rotation: a cache as wide as this default's activations follows the new default's, a
        narrower one is kept."""
        kv = None if self.kv_bits == self.scheme.activation.bits else self.kv_bits
        return Recipe(default, tuple(rules), kv, embedding, lm_head, name, self.rotate)

    def with_default(self, scheme: str) -> "Recipe":
        """The same rules and options around another default scheme (``--scheme`` with ``--recipe``)."""
        get_scheme(scheme)
        return self.with_formats(scheme, self.rules, self.embedding, self.lm_head,
                                 f"{self.name}@{scheme}" if self.name != self.default else scheme)

    def with_rotation(self, rotate: str | None) -> "Recipe":
        """The same recipe with rotation ``rotate`` (``--rotate``; None: none), named for it when it changes."""
        if rotate == self.rotate:
            return self
        return replace(self, rotate=rotate, name=f"{self.name}+{rotate or 'norotate'}")

    def resolve(self, path: str, kind: str) -> tuple[Scheme, str]:
        """(scheme, label of the rule that decided) for one layer."""
        if self.lm_head is not None and path == LM_HEAD_PATH:
            return get_scheme(self.lm_head), "option lm_head"
        best: tuple[int, int] | None = None
        for i, rule in enumerate(self.rules):
            if rule.matches(path, kind) and (best is None or rule.priority > best[0]):
                best = (rule.priority, i)
        if best is None:
            return get_scheme(self.default), "default"
        return get_scheme(self.rules[best[1]].scheme), f"rule {best[1]}"

    def plan(self, layers: Iterable[tuple[str, str]]) -> "RecipePlan":
        """Match every (module path, op kind) layer; a rule that matches nothing is an error."""
        layers = list(dict.fromkeys(layers))
        rows = []
        for path, kind in layers:
            scheme, label = self.resolve(path, kind)
            rows.append(LayerAssignment(path, kind, label, scheme.name))
        unused = [i for i, rule in enumerate(self.rules) if not any(rule.matches(p, k) for p, k in layers)]
        if unused:
            i = unused[0]
            raise NpuqError(
                f"recipe {self.name!r} rule {i} ({self.rules[i].describe()}) matches no layer of this model; "
                f"module paths look like {_examples(layers)}: fix the regex or op kind"
            )
        if self.lm_head is not None and not any(p == LM_HEAD_PATH for p, _ in layers):
            raise NpuqError(f"recipe {self.name!r} sets lm_head but the model has no {LM_HEAD_PATH!r} layer")
        return RecipePlan(self, tuple(rows))

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "default": self.default, "kv_bits": self.kv_bits, "embedding": self.embedding,
            "lm_head": self.lm_head, "rotate": self.rotate,
            "rules": [{"op": r.op, "path": r.path, "scheme": r.scheme, "priority": r.priority} for r in self.rules],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], name: str = "") -> "Recipe":
        if not isinstance(data, dict):
            raise NpuqError(f"recipe {name or ''} must be a JSON object, got {type(data).__name__}")
        allowed = {"name", "default", "rules", "kv_bits", "embedding", "lm_head", "rotate"}
        unknown = sorted(set(data) - allowed)
        if unknown:
            raise NpuqError(f"recipe {name!r}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}")
        if "default" not in data:
            raise NpuqError(f"recipe {name!r} has no 'default' scheme; add e.g. \"default\": \"16a8w\"")
        if not isinstance(data.get("rules", []), list) or not isinstance(data.get("name", ""), str):
            raise NpuqError(f"recipe {name!r}: 'rules' must be a list of objects and 'name' a string")
        rules = []
        for i, r in enumerate(data.get("rules", [])):
            if not isinstance(r, dict):
                raise NpuqError(f"recipe {name!r} rule {i} must be an object, got {r!r}")
            bad = sorted(set(r) - {"op", "path", "scheme", "priority"})
            if bad:
                raise NpuqError(f"recipe {name!r} rule {i}: unknown key(s) {', '.join(bad)}; allowed: op, path, scheme, priority")
            if "scheme" not in r:
                raise NpuqError(f"recipe {name!r} rule {i} has no 'scheme'")
            rules.append(Rule(r["scheme"], r.get("op"), r.get("path"), r.get("priority", 0)))
        return cls(data["default"], tuple(rules), data.get("kv_bits"), data.get("embedding", "shared"),
                   data.get("lm_head"), data.get("name") or name, data.get("rotate"))


@dataclass(frozen=True)
class LayerAssignment:
    path: str
    kind: str
    rule: str  # "default", "rule N" or "option lm_head"
    scheme: str


@dataclass(frozen=True)
class RecipePlan:
    """A recipe matched against one model's layers."""

    recipe: Recipe
    layers: tuple[LayerAssignment, ...] = field(default=())

    def scheme_of(self, path: str, kind: str) -> Scheme:
        return self.recipe.resolve(path, kind)[0]

    def summary(self) -> str:
        """One line per layer: module path, op kind, the rule that matched, the scheme."""
        r = self.recipe
        head = [f"recipe {r.name}: default {r.default}, kv_bits {r.kv_bits}, embedding {r.embedding}, "
                f"lm_head {r.lm_head or '(rules)'}, rotate {r.rotate or 'none'}"]
        head += [f"  rule {i}: {rule.describe()}" for i, rule in enumerate(r.rules)]
        w = max((len(a.path or "(top)") for a in self.layers), default=4)
        rows = [f"  {(a.path or '(top)'):<{w}}  {a.kind:<11}  {a.rule:<14}  {a.scheme}" for a in self.layers]
        return "\n".join(head + rows)

    def to_list(self) -> list[dict[str, str]]:
        return [{"path": a.path, "kind": a.kind, "rule": a.rule, "scheme": a.scheme} for a in self.layers]


def _examples(layers: Sequence[tuple[str, str]]) -> str:
    paths = [p for p, _ in layers if p]
    return ", ".join(repr(p) for p in paths[:3]) + (" ..." if len(paths) > 3 else "")


# --------------------------------------------------------------------------- built-ins
# 4- and 8-bit weights (16a4w*, 16a8w) come with R1 folded in (docs/design.md §12). On
# SmolLM2-135M (bench/accuracy.py, builtin eval split / prose of another domain, × float word
# perplexity): 16a4w + SeqMSE + GPTQ 1.56 / 4.09 → 1.26 / 1.90; 16a8w 1.017 / 1.028 → 1.011 /
# 1.009. 16a16w too: its 16-bit activation grids lose less to outlier channels once rotated (KL
# divergence from float, builtin eval split, 4096 tokens: 0.0125 → 0.0021 nats, README). 8a8w was
# not measured and keeps its weights unrotated.
DEFAULT_ROTATION = "r1"
ROTATED_BY_DEFAULT = ("16a16w", "16a8w", "16a4w", "16a4w_block")
RECIPES: dict[str, Recipe] = {
    name: Recipe(name, rotate=DEFAULT_ROTATION if name in ROTATED_BY_DEFAULT else None) for name in SCHEMES
}
_DOWN_PROJ_8BIT = (Rule("16a8w", op="linear", path=r"layers\.\d+\.mlp\.down_proj", priority=1),)
RECIPES["16a4w_mixed"] = Recipe("16a4w", _DOWN_PROJ_8BIT, lm_head="16a8w", name="16a4w_mixed", rotate=DEFAULT_ROTATION)
# docs/design.md §1: 16a4w everywhere, lm head and down projections at 16a8w. The same with LPBQ
# blocks for the 4-bit layers: the same bits per weight (a block's 4-bit scale is not a code bit),
# and on SmolLM2-135M with SeqMSE + GPTAQ the best 4-bit recipe measured (docs/design.md §5).
RECIPES["16a4w_block_mixed"] = Recipe("16a4w_block", _DOWN_PROJ_8BIT, lm_head="16a8w", name="16a4w_block_mixed",
                                      rotate=DEFAULT_ROTATION)

# The recipe when neither --recipe nor --scheme is given: the same for every model, whatever its
# name or path. Its rotation is decided from the model itself where it is folded in:
# rotate_model applies R1 only where it is exact (not across Gemma 3's sandwich norms unless
# their gammas are all-equal, docs/design.md §12). The Qwen2.5-Coder built-ins used to be keyed
# to unrotated 16a8w because R1 made them score below float; the cause was int32 biases clamped
# by the quantizer (npuq.quant.bias), not the rotation, and with it fixed R1 keeps every layer
# of Qwen2.5-Coder-0.5B within the measured margin of unrotated (docs/design.md §12).
DEFAULT_RECIPE = "16a8w"


def default_recipe() -> Recipe:
    return RECIPES[DEFAULT_RECIPE]


def load_recipe(spec: str | None, scheme: str | None = None, rotate: str | None = None) -> Recipe:
    """The recipe for the CLI's ``--recipe`` / ``--scheme`` / ``--rotate``.

    ``spec``: a built-in recipe name or a .json file; None: the default (:func:`default_recipe`). ``scheme``
    replaces the recipe's default scheme (with no ``spec``: the uniform recipe of that scheme).
    ``rotate`` (one of ROTATE_CHOICES) replaces the recipe's own rotation, "none" by none; None
    keeps it. The rotation is decided here and nowhere else: the recipe returned holds it
    (:attr:`Recipe.rotation`).
    """
    if scheme is not None:
        get_scheme(scheme)
    if rotate is not None and rotate not in ROTATE_CHOICES:
        raise NpuqError(f"unknown --rotate {rotate!r}; choose one of {', '.join(ROTATE_CHOICES)}")
    if spec is None:
        recipe = RECIPES[scheme] if scheme is not None else default_recipe()
    elif spec in RECIPES:
        recipe = RECIPES[spec]
    else:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise NpuqError(f"--recipe {spec!r} is neither a built-in recipe ({', '.join(RECIPES)}) nor a JSON file")

        data = read_json(path, f"--recipe {spec}", "write the recipe as a JSON object (see 'npuq quantize --help')")
        recipe = Recipe.from_dict(data, name=path.stem)
    if scheme is not None and scheme != recipe.default:
        recipe = recipe.with_default(scheme)
    return recipe if rotate is None else recipe.with_rotation(None if rotate == "none" else rotate)


def kv_cache_advice(bits: int) -> str:
    """How a recipe asks for a ``bits``-wide KV cache, for the advice of a later stage that needs one."""
    return f'a recipe that has "kv_bits": {bits} (a JSON recipe file such as {{"default": "16a8w", "kv_bits": {bits}}})'

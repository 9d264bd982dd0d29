"""The family registry: lookup by model_type / architectures, capabilities, refusals."""

from __future__ import annotations

import pytest
from ec_frontend.model.registry import (
    FAMILIES,
    PositionSpec,
    UnsupportedModelError,
    family_for,
)


@pytest.mark.parametrize(
    ("config", "name"),
    [
        ({"model_type": "qwen2_vl"}, "Qwen2-VL"),
        ({"model_type": "qwen2_5_vl", "architectures": ["Anything"]}, "Qwen2.5-VL"),
        ({"model_type": "llava"}, "LLaVA-1.5"),
        ({"architectures": ["Qwen2_5_VLForConditionalGeneration"]}, "Qwen2.5-VL"),
        ({"architectures": ["Foo", "LlavaForConditionalGeneration"]}, "LLaVA-1.5"),
    ],
)
def test_family_for(config, name):
    assert family_for(config).name == name


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"model_type": "gemma3"}, "unsupported model_type 'gemma3'"),
        # model_type wins over architectures: a mislabelled config is not guessed.
        (
            {"model_type": "llama", "architectures": ["Qwen2VLForConditionalGeneration"]},
            "unsupported model_type 'llama'",
        ),
        ({"architectures": ["Idefics3ForConditionalGeneration"]}, "unsupported model_type None"),
        ({}, r"architectures \[\]"),
    ],
)
def test_unsupported_configs_name_the_supported_families(config, match):
    with pytest.raises(UnsupportedModelError, match=match) as info:
        family_for(config)
    for model_type in FAMILIES:
        assert model_type in str(info.value)


def test_every_registered_family_declares_its_keys():
    for model_type in FAMILIES:
        family = family_for({"model_type": model_type})
        assert model_type in family.model_types
        assert family.architectures
        assert family.weight_part("no.such.prefix.weight") is None


@pytest.mark.parametrize(
    ("spec", "delta"),
    [(PositionSpec("mrope", (16, 24, 24)), True), (PositionSpec("rope"), False)],
)
def test_only_mrope_families_carry_a_position_delta(spec, delta):
    assert spec.uses_mrope_delta is delta


def test_weight_parts_of_both_checkpoint_layouts():
    qwen = family_for({"model_type": "qwen2_5_vl"})
    assert qwen.weight_part("visual.blocks.0.attn.qkv.weight") == (
        "vision",
        "blocks.0.attn.qkv.weight",
    )
    assert qwen.weight_part("model.language_model.norm.weight") == ("language", "norm.weight")
    assert qwen.weight_part("model.layers.0.mlp.up_proj.weight") == (
        "language",
        "layers.0.mlp.up_proj.weight",
    )
    llava = family_for({"model_type": "llava"})
    assert llava.weight_part("language_model.lm_head.weight") == ("language", "lm_head.weight")
    assert llava.weight_part("model.multi_modal_projector.linear_1.bias") == (
        "vision",
        "multi_modal_projector.linear_1.bias",
    )


@pytest.fixture
def out_of_tree_family():
    """An out-of-tree family module: Qwen2-VL's family under a model_type of its own."""
    import dataclasses
    import sys
    import types

    from ec_frontend.model import registry
    from ec_frontend.model.qwen2_vl import FAMILY as QWEN2_VL

    module = types.ModuleType("out_of_tree_family")
    module.FAMILY = dataclasses.replace(
        QWEN2_VL, name="Out-of-tree", model_types=("out_of_tree_vl",), architectures=("OOTVL",)
    )
    sys.modules[module.__name__] = module
    yield module
    registry._FAMILIES.pop("out_of_tree_vl", None)
    del sys.modules[module.__name__]


def test_register_family_serves_an_out_of_tree_module(out_of_tree_family):
    from ec_frontend.model.registry import register_family

    with pytest.raises(UnsupportedModelError):
        family_for({"model_type": "out_of_tree_vl"})
    register_family("out_of_tree_vl", out_of_tree_family.__name__)
    assert "out_of_tree_vl" in FAMILIES
    assert family_for({"model_type": "out_of_tree_vl"}) is out_of_tree_family.FAMILY
    # Found by its architectures too, as an in-tree family is.
    assert family_for({"architectures": ["OOTVL"]}) is out_of_tree_family.FAMILY


@pytest.mark.parametrize("model_type", ["qwen2_vl", "llava_onevision"])
def test_register_family_refuses_a_registered_model_type(model_type):
    from ec_frontend.model.registry import register_family

    before = dict(FAMILIES)
    with pytest.raises(ValueError, match=f"model_type '{model_type}' is already registered"):
        register_family(model_type, "somewhere.else")
    assert dict(FAMILIES) == before


def test_the_family_table_is_read_only():
    with pytest.raises(TypeError):
        FAMILIES["x"] = "y"  # type: ignore[index]

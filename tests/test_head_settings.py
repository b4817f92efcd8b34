"""Per-type head settings: `HeadConfig` holds the shared keys, each type's own settings live in its folder's
dataclass (`head_types/<type>/settings.py`); the flat `head.<key>` form is what the user, the YAML and a saved head
say, checked against the chosen type (another type's key names that type), and a type derives `loss.steps`."""

from __future__ import annotations

import dataclasses

import pytest
from omegaconf import OmegaConf

from mtp_train.config import ConfigError, HeadConfig, TrainConfig, typed
from mtp_train.config.checks import check_config, check_overrides, plain
from mtp_train.config.head import HEAD_TYPES, SHARED_KEYS, HeadSettings, head_keys, head_spec
from mtp_train.head_types.dflash.settings import MAX_BLOCK_SIZE, BlockSettings
from mtp_train.head_types.dspark.settings import DEFAULT_MARKOV_RANK, DSparkSettings
from mtp_train.head_types.eagle3.settings import Eagle3Settings
from mtp_train.head_types.peagle.settings import PEagleSettings
from tests.conftest import compose_config

OWN = {"mtp": None, "eagle1": None, "eagle3": Eagle3Settings, "peagle": PEagleSettings, "dflash": BlockSettings,
       "dspark": DSparkSettings}


def _vocab(name: str) -> dict[str, int]:
    return {"draft_vocab_size": 8} if head_spec(name).draft_vocab_required else {}


@pytest.mark.parametrize("name", sorted(OWN))
def test_each_type_names_its_settings_and_round_trips_the_flat_form(name):
    """spec.settings names the dataclass; HeadConfig.settings holds an instance of it (the empty base for a type
    without); to_dict is flat (shared keys, then the type's own) and from_dict reads it back."""
    assert head_spec(name).settings is OWN[name]
    cfg = HeadConfig(type=name, **_vocab(name))
    assert type(cfg.settings) is (OWN[name] or HeadSettings)
    flat = cfg.to_dict()
    assert list(flat) == head_keys(name) and "settings" not in flat
    assert list(flat)[:len(SHARED_KEYS)] == list(SHARED_KEYS)
    assert HeadConfig.from_dict(flat) == cfg.resolved()
    assert HeadConfig.from_dict(flat).to_dict() == flat


def test_of_splits_the_types_own_keys_from_the_shared_ones():
    cfg = HeadConfig.of(type="dspark", block_size=4, layers=2, confidence_head=True, aux_layers=[1, 2])
    assert cfg.aux_layers == [1, 2] and cfg.settings == DSparkSettings(layers=2, block_size=4, confidence_head=True)
    assert cfg.resolved().settings.markov_rank == DEFAULT_MARKOV_RANK and cfg.settings.markov_rank is None
    assert HeadConfig.of(type="eagle3", draft_vocab_size=8, norm_output=True).settings == Eagle3Settings(True)
    assert HeadConfig.of(type="peagle", draft_vocab_size=8, mask_token_id=5).settings.mask_token_id == 5
    # the typed instance or a mapping of its keys may be given directly
    assert HeadConfig(type="dflash", settings={"block_size": 4}).settings == BlockSettings(block_size=4)
    with pytest.raises(ValueError, match="head.settings is a DSparkSettings: dflash heads take BlockSettings"):
        HeadConfig(type="dflash", settings=DSparkSettings())


@pytest.mark.parametrize(("name", "keys", "message"), [
    ("mtp", {"block_size": 4}, r"head.block_size is a dflash / dspark setting \(head=dflash or head=dspark\); "
                               "mtp heads have no such setting"),
    ("dflash", {"markov_rank": 4}, r"head.markov_rank is a dspark setting \(head=dspark\); dflash heads have no such"),
    ("peagle", {"norm_output": True}, r"head.norm_output is an eagle3 setting \(head=eagle3\); peagle heads"),
    ("eagle3", {"mask_token_id": 3}, r"head.mask_token_id is a dflash / dspark / peagle setting"),
    ("dflash", {"blok_size": 4}, r"unknown config key `head.blok_size`.*did you mean `head.block_size`\?"),
    ("mtp", {"blok_size": 4}, r"did you mean `head.block_size`\? \(a setting of dflash / dspark heads, not of mtp"),
])
def test_a_key_the_type_does_not_take_names_its_owner_or_the_nearest_key(name, keys, message):
    with pytest.raises(ValueError, match=message):
        HeadConfig.of(type=name, **_vocab(name), **keys)


@pytest.mark.parametrize(("cls", "keys", "message"), [
    (BlockSettings, {"block_size": 1_000_000}, rf"head.block_size=1000000 is over {MAX_BLOCK_SIZE}.*choose at most"),
    (BlockSettings, {"block_size": 1}, "block_size >= 2"),
    (BlockSettings, {"layers": 0}, "head.layers >= 1"),
    (BlockSettings, {"mask_token_id": -1}, "head.mask_token_id must be a token id >= 0"),
    (DSparkSettings, {"markov_rank": 0}, "markov_rank >= 1"),
    (DSparkSettings, {"confidence_with_markov": True}, "confidence_with_markov=true needs head.confidence_head=true"),
    (PEagleSettings, {"mask_token_id": -2}, "head.mask_token_id must be a token id >= 0"),
])
def test_each_settings_dataclass_checks_its_values(cls, keys, message):
    with pytest.raises(ValueError, match=message):
        cls(**keys)


def test_block_size_is_bounded_and_its_memory_estimated():
    """head.block_size past MAX_BLOCK_SIZE is refused by key with the bound; `block_bytes` is the lower bound that
    mtp-train compares with the free memory (tests/test_bad_inputs.py runs both through the command)."""
    assert HeadConfig.of(type="dflash", block_size=MAX_BLOCK_SIZE).settings.block_size == MAX_BLOCK_SIZE
    cfg = HeadConfig.of(type="dflash", block_size=16, max_anchors=512, layers=2)
    assert cfg.settings.block_bytes(hidden_size=4096) == 512 * 16 * 4096 * 2 * 4
    fits = dict(hidden_size=4096, human=str, target="t/config.json", device="cpu")
    assert cfg.settings.fit_problem(16, free_bytes=lambda: None, **fits) is None
    assert "max_position_embeddings (8, t/config.json)" in cfg.settings.fit_problem(8, free_bytes=lambda: None,
                                                                                       **fits)
    assert "free on cpu" in cfg.settings.fit_problem(16, free_bytes=lambda: 1, **fits)
    assert HeadConfig(type="mtp").settings.fit_problem(1, free_bytes=lambda: 1, **fits) is None


def test_a_head_saved_before_per_type_settings_still_loads():
    """Every head's config.json recorded all twenty keys; those another type owns hold the value such a head
    recorded and are dropped. A value that means something is not silently dropped."""
    legacy = {"layers": 1, "block_size": 8, "mask_token_id": None, "max_anchors": 512, "markov_rank": None,
              "confidence_head": False, "confidence_with_markov": False, "norm_output": False}
    shared = HeadConfig(type="mtp").to_dict()
    assert HeadConfig.from_dict({**shared, **legacy}) == HeadConfig(type="mtp").resolved()
    old_dspark = {**shared, **legacy, "type": "dspark", "features": "aux", "block_size": 4, "markov_rank": 64}
    assert HeadConfig.from_dict(old_dspark).settings == DSparkSettings(block_size=4, markov_rank=64)
    old_eagle3 = {**shared, **legacy, "type": "eagle3", "features": "aux", "draft_vocab_size": 8}
    assert HeadConfig.from_dict(old_eagle3).settings == Eagle3Settings()
    with pytest.raises(ValueError, match="head.block_size is a dflash / dspark setting"):
        HeadConfig.from_dict({**shared, **legacy, "block_size": 16})


@pytest.mark.parametrize(("name", "block", "steps"), [("dflash", 4, 3), ("dspark", 4, 4), ("dflash", 16, 15)])
def test_a_block_drafter_derives_loss_steps_from_its_block(name, block, steps):
    cfg = typed({"head": {"type": name, "block_size": block}}, TrainConfig)
    assert cfg.loss.steps == steps and cfg.head.settings.derived() == {"loss.steps": steps}
    assert typed({"head": {"type": name, "block_size": block}, "loss": {"steps": steps}}, TrainConfig).loss.steps \
        == steps
    with pytest.raises(ConfigError, match=rf"loss.steps=2 contradicts the head: {name} heads train one step per "
                                          rf"drafted slot, loss.steps={steps} \(head.block_size={block}"):
        typed({"head": {"type": name, "block_size": block}, "loss": {"steps": 2}}, TrainConfig)
    with pytest.raises(ConfigError, match="loss.step_weights has 2 weights"):
        typed({"head": {"type": name, "block_size": block}, "loss": {"step_weights": [1.0, 0.5]}}, TrainConfig)
    # a chain head derives nothing: loss.steps left unset is 1
    assert typed({"head": {"type": "mtp"}}, TrainConfig).loss.steps == 1
    assert HEAD_TYPES.get("mtp").spec.settings is None


def test_the_yaml_and_the_command_line_say_the_settings_flat():
    """conf/head/<type>.yaml lists the shared keys and the type's own only; the composed config is flat and typed
    into HeadConfig, loss.steps following the block."""
    for name in OWN:
        cfg = compose_config("train", [f"head={name}"])
        assert sorted(cfg.head) == sorted(head_keys(name)), name
        check_config(cfg, "train")
    cfg = compose_config("train", ["head=dspark", "head.block_size=5", "head.confidence_head=true"])
    assert cfg.loss.steps is None
    tc = typed(check_config(cfg, "train"), TrainConfig)
    assert tc.head.settings == DSparkSettings(block_size=5, markov_rank=64, confidence_head=True)
    assert tc.loss.steps == 5
    assert dataclasses.asdict(tc.head.settings)["confidence_head"] is True
    # Hydra's schema is a TrainConfig whose head is composed flat: building it types the head and runs every check
    built = OmegaConf.to_object(cfg)
    assert isinstance(built, TrainConfig) and built.head == tc.head and built.loss.steps == 5
    assert typed(built, TrainConfig) == tc and type(typed(built, TrainConfig)) is TrainConfig
    # a run records its settings with the head flat (train_config.yaml), and they read back
    recorded = plain(tc)
    assert recorded["head"] == tc.head.to_dict(resolve=False) and recorded["head"]["block_size"] == 5
    assert "settings" not in recorded["head"] and typed(OmegaConf.create(recorded), TrainConfig) == tc


def test_a_peagle_heads_placeholder_token_is_its_setting(tiny_checkpoints):
    """P-EAGLE's slots read head.mask_token_id (null = the target's last vocabulary id), as dflash's blocks do."""
    from mtp_train.heads import build_head

    folder = tiny_checkpoints["llama"][0]
    default = build_head(HeadConfig.of(type="peagle", draft_vocab_size=8), folder, dtype="float32")
    assert default.mask_token_id == default.args.vocab_size - 1
    head = build_head(HeadConfig.of(type="peagle", draft_vocab_size=8, mask_token_id=5), folder, dtype="float32")
    assert head.mask_token_id == 5 and head.slot_inputs(3)[1].tolist() == [5, 5, 5]
    with pytest.raises(ValueError, match="head.mask_token_id=100000 is not a token of the target's vocabulary"):
        build_head(HeadConfig.of(type="peagle", draft_vocab_size=8, mask_token_id=100_000), folder, dtype="float32")


@pytest.mark.parametrize(("overrides", "message"), [
    (["head=dflash", "head.markov_rank=4"], r"head.markov_rank is a dspark setting \(head=dspark\); dflash heads "),
    (["head.block_size=4"], r"head.block_size is a dflash / dspark setting .*; mtp heads have no such setting"),
    (["head=eagle1", "head.norm_output=true"], r"head.norm_output is an eagle3 setting"),
    (["head=dflash", "head.blok_size=4"], r"unknown config key `head.blok_size`.*did you mean `head.block_size`"),
    (["head=dflash", "head.block_size=abc"], r"`head.block_size=abc`: `head.block_size` takes an integer"),
    (["head=dflash", "head.settings.block_size=4"], r"unknown config key `head.settings.block_size`"),
])
def test_the_command_line_checks_head_keys_against_the_chosen_type(overrides, message):
    with pytest.raises(ConfigError, match=message):
        check_overrides(overrides, "train")


def test_the_command_line_takes_the_chosen_types_own_keys():
    check_overrides(["head=dspark", "head.markov_rank=4", "head.block_size=16"], "train")
    check_overrides(["head=peagle", "head.mask_token_id=3"], "train")
    check_overrides(["head.type=dflash", "head.block_size=16"], "train")

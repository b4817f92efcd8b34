"""The one registry helper (`mtp_train.config.registry`): names checked, a second registration refused, an unknown
name answered with the known ones, and plug-in modules found by scanning a package on the first read."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mtp_train.config.registry import Registry, RegistryError


class Entry:
    def __init__(self, name: str) -> None:
        self.name = name


def test_entries_are_added_where_they_are_defined_and_names_are_checked():
    reg: Registry[Entry] = Registry("widget")
    a = reg.add(Entry("a"))
    assert reg["a"] is a and reg.names() == ("a",) and "a" in reg and len(reg) == 1

    @reg.add
    class B:  # a class registers itself with the decorator, under its `name`
        name = "b"

    assert reg.get("b") is B and list(reg) == ["a", "b"]
    with pytest.raises(RegistryError, match="widget 'a' is registered twice"):
        reg.add(Entry("a"))
    with pytest.raises(RegistryError, match="widget name 'Bad Name' is not a lower-case name"):
        reg.add(Entry("Bad Name"))
    with pytest.raises(RegistryError, match="unknown widget 'c'; choose one of a, b"):
        reg.get("c")
    assert isinstance(RegistryError("x"), ValueError)  # config checks report it as a bad value
    assert reg.unregister("b") is B and reg.names() == ("a",)


def test_on_add_can_refuse_an_entry_before_it_is_registered():
    seen: set[str] = set()

    def unique_colour(e: Entry) -> None:
        colour = e.name.split("-")[0]
        if colour in seen:
            raise TypeError(f"colour {colour} is claimed twice")
        seen.add(colour)

    reg: Registry[Entry] = Registry("widget", on_add=unique_colour)
    reg.add(Entry("red-1"))
    with pytest.raises(TypeError, match="colour red is claimed twice"):
        reg.add(Entry("red-2"))
    assert reg.names() == ("red-1",)


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def _run(root: Path, code: str) -> subprocess.CompletedProcess[str]:
    """`code` in a fresh interpreter with `root` on the path (a package scanned there is imported once, there)."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=root, capture_output=True, text=True,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}, timeout=120)


def test_a_package_scan_finds_plug_ins_that_add_themselves_or_define_an_attribute(tmp_path):
    """`package=`: the first read imports the package and each module / sub-package in it by computed name (not
    before: declaring the registry imports nothing); modules either add their entries themselves or define `attr`,
    which the scan adds under the module's name; `packages_only` and `optional` skip the shared parts."""
    _write(tmp_path, {
        "plugs/__init__.py": "",
        "plugs/registry.py": """
            from mtp_train.config.registry import Registry
            SELF = Registry("self-added widget", "plugs.selfadd")
            ATTR = Registry("widget", "plugs.byattr", attr="WIDGET", packages_only=True, optional=True)
            STRICT = Registry("strict widget", "plugs.strict", attr="WIDGET")
        """,
        "plugs/selfadd/__init__.py": "",
        "plugs/selfadd/one.py": """
            from plugs.registry import SELF
            @SELF.add
            class One:
                name = "one"
        """,
        "plugs/selfadd/two.py": "from plugs.registry import SELF\nclass Two:\n    name = 'two'\nSELF.add(Two)\n",
        "plugs/byattr/__init__.py": "",
        "plugs/byattr/shared.py": "WIDGET = 'not a plug-in: a module beside the folders'\n",
        "plugs/byattr/alpha/__init__.py": "class W:\n    name = 'alpha'\nWIDGET = W()\n",
        "plugs/byattr/beta/__init__.py": "# no WIDGET: skipped (optional)\n",
        "plugs/strict/__init__.py": "",
        "plugs/strict/gamma.py": "class W:\n    name = 'delta'\nWIDGET = W()\n",
    })
    done = _run(tmp_path, """
        import sys
        from plugs.registry import ATTR, SELF, STRICT
        assert "plugs.selfadd.one" not in sys.modules  # nothing imported before the first read
        assert sorted(SELF.names()) == ["one", "two"], SELF.names()
        assert ATTR.names() == ("alpha",), ATTR.names()
        try:
            STRICT.names()
        except TypeError as e:
            print("refused:", e)
    """)
    assert done.returncode == 0, done.stderr
    assert "refused: plugs.strict.gamma.WIDGET is not a strict widget named 'gamma'" in done.stdout


def test_a_plain_module_is_imported_alone_and_a_scanned_module_without_the_attribute_is_refused(tmp_path):
    _write(tmp_path, {
        "mod_reg/__init__.py": "from mtp_train.config.registry import Registry\n"
                               "KINDS = Registry('kind', 'mod_reg.fill')\n"
                               "FAMS = Registry('family', 'mod_reg.fams', attr='FAMILY')\n",
        "mod_reg/fill.py": "from mod_reg import KINDS\nclass K:\n    name = 'k1'\nKINDS.add(K)\n",
        "mod_reg/fams/__init__.py": "",
        "mod_reg/fams/stray.py": "X = 1\n",
    })
    done = _run(tmp_path, """
        from mod_reg import FAMS, KINDS
        assert KINDS.names() == ("k1",)
        try:
            FAMS.get("stray")
        except TypeError as e:
            print("refused:", e)
        try:
            FAMS.get("stray")  # a failed discovery is tried again (and fails again), never half-done silently
        except TypeError as e:
            print("again:", e)
    """)
    assert done.returncode == 0, done.stderr
    assert "refused: mod_reg.fams.stray defines no FAMILY; every module of mod_reg.fams is a family plug-in" in (
        done.stdout)
    assert "again: mod_reg.fams.stray defines no FAMILY" in done.stdout


def test_the_project_registries_use_the_one_mechanism():
    """Families are found by the package scan; the loss kinds and data sources are declared on the settings floor
    and filled by the modules that define them; the names of the registries and tables do not collide."""
    from mtp_train.config.data import DATA_SOURCES
    from mtp_train.config.loss import TOKEN_LOSSES
    from mtp_train.eval.methods import METHODS
    from mtp_train.models.families import FAMILIES

    assert FAMILIES.package == "mtp_train.models.families" and FAMILIES.attr == "FAMILY"
    assert {"llama", "deepseek_v3"} <= set(FAMILIES)
    assert DATA_SOURCES.package == "mtp_train.train.sources" and "offline" in DATA_SOURCES
    assert TOKEN_LOSSES.package == "mtp_train.train.divergences" and "soft_ce" in TOKEN_LOSSES
    assert {"none", "head", "draft", "ngram"} <= set(METHODS)
    import mtp_train.config.data as data
    import mtp_train.config.eval as ev
    import mtp_train.config.loss as loss
    import mtp_train.layers.attention.base as attention
    import mtp_train.precompute.vllm_backend as precompute

    assert not hasattr(data, "SOURCES") and not hasattr(loss, "LOSS_KINDS")
    assert not any(hasattr(m, "BACKENDS") for m in (ev, attention, precompute))
    assert ev.EVAL_BACKENDS and attention.ATTENTION_BACKENDS and precompute.PRECOMPUTE_BACKENDS


def test_the_head_type_discovery_is_one_package_scan():
    """What `config/head.py` discovers by hand (the sub-packages of mtp_train.head_types that define HEAD_TYPE, then
    the entry points of its group) is one `Registry(package=...)` declaration: the same entries, the same objects."""
    from mtp_train.config.head import HEAD_TYPE_GROUP, HEAD_TYPE_PACKAGE, HEAD_TYPES, HeadType

    scanned: Registry[HeadType] = Registry("head type", HEAD_TYPE_PACKAGE, attr="HEAD_TYPE", packages_only=True,
                                           optional=True, group=HEAD_TYPE_GROUP, entry_type=HeadType)
    assert {"mtp", "eagle1", "eagle3", "dflash"} <= set(scanned)
    assert all(HEAD_TYPES.get(name) is entry for name, entry in scanned.items())

"""The docs tree stays navigable and true to the code: the configuration
reference lists exactly the pydantic models' fields (with their types,
defaults and descriptions), and every relative link in README.md and
docs/*.md resolves - the file exists and an ``#anchor`` names a heading of
that file by GitHub's rules.  Each check has its negative control."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

from pydantic import Field

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
_CODE = re.compile(r"`[^`]+`")
_LINK = re.compile(r"\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)


def _prose(text: str) -> str:
    """The text outside fenced code blocks and code spans (links there are
    not links)."""
    return _CODE.sub("", _FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text lower-cased, every
    character but letters, marks, digits, connector punctuation (``_``),
    spaces and hyphens dropped, spaces turned into hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text).lower()              # inline HTML
    kept = "".join(c for c in text if c in " -" or unicodedata.category(c)[0] in "LMN"
                   or unicodedata.category(c) == "Pc")
    return kept.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading's anchor in a markdown file; a repeated one gets -1, -2."""
    seen: dict[str, int] = {}
    out = set()
    for _, title in _HEADING.findall(_FENCE.sub("", text)):
        base = slug(title)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """The relative links of ``page`` that do not resolve, with the reason."""
    bad = []
    for target in _LINK.findall(_prose(page.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if root not in dest.parents and dest != root:
            bad.append(f"{page.name}: {target} (outside the repository)")
        elif not dest.exists():
            bad.append(f"{page.name}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            bad.append(f"{page.name}: {target} (no heading #{anchor} in {dest.name})")
    return bad


def test_every_relative_link_resolves():
    assert len(PAGES) > 5, PAGES  # the docs tree is there
    links = sum(len(_LINK.findall(_prose(p.read_text()))) for p in PAGES)
    assert links > 30, links
    assert [b for p in PAGES for b in broken_links(p)] == []


def test_link_check_catches_a_missing_file_and_a_wrong_anchor(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## The `pool` command: info\n")
    page = tmp_path / "page.md"
    page.write_text("# Page\n\n## A heading, with punctuation!\n\n"
                    "[ok](other.md#the-pool-command-info) [self](#a-heading-with-punctuation)\n"
                    "[two\nlines](other.md) [web](https://example.com/x#y)\n"
                    "`[in code](nowhere.md)`\n```\n[fenced](nowhere.md)\n```\n")
    assert broken_links(page, tmp_path) == []
    page.write_text(page.read_text() + "[gone](missing.md) [bad](other.md#no-such-heading) "
                    "[typo](#a-heading-with-punctuation-)\n")
    assert broken_links(page, tmp_path) == [
        "page.md: missing.md (no such file)",
        "page.md: other.md#no-such-heading (no heading #no-such-heading in other.md)",
        "page.md: #a-heading-with-punctuation- (no heading #a-heading-with-punctuation- "
        "in page.md)"]
    # a file that exists, but outside the repository (a page of another checkout)
    (tmp_path / "repo").mkdir()
    inner = tmp_path / "repo" / "page.md"
    inner.write_text("[escape](../other.md)\n")
    assert broken_links(inner, tmp_path / "repo") == ["page.md: ../other.md (outside the repository)"]


def test_slug_follows_githubs_rules():
    assert slug("What ran on a real GPU") == "what-ran-on-a-real-gpu"
    assert slug("Looking inside a pool: the `pool` command") == \
        "looking-inside-a-pool-the-pool-command"
    assert slug("The pool connector: `kv_connector_extra_config`") == \
        "the-pool-connector-kv_connector_extra_config"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n## A\n") == {"a", "a-1", "a-2"}


def _section(text: str, begin: str, end: str) -> str:
    return text.split(begin, 1)[1].split(end, 1)[0].strip("\n") + "\n"


def _config_section() -> str:
    return _section((ROOT / "docs" / "configuration.md").read_text(),
                    "<!-- pool-config-table:begin -->", "<!-- pool-config-table:end -->")


def _fields(table: str) -> list[list[str]]:
    """The field column of each table in the section, in order."""
    return [[line.split("|")[1].strip().strip("`") for line in block.splitlines()[2:]]
            for block in table.strip().split("\n\n")]


def test_configuration_reference_is_the_models():
    from vllm_layerwise_patch.pool.config import MooncakeConfig, PoolConfig
    from vllm_layerwise_patch.pool.config_doc import reference

    page = _config_section()
    assert page == reference(PoolConfig, MooncakeConfig), "run: python scripts/render_readme.py"
    assert _fields(page) == [list(PoolConfig.model_fields), list(MooncakeConfig.model_fields)]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:5]]
            for line in page.splitlines() if line.startswith("| `")}
    assert rows["`capacity`"][:2] == ["size", "`4GiB`"]
    assert rows["`prefetch_layers`"][:2] == ["integer, ≥ 1 and ≤ 64", "`2`"]
    assert rows["`backend`"][0] == '`"lmdb"` or `"mooncake"` or `"tiered"`'
    assert rows["`client_address`"][:2] == ["`host:port`, or unset", "unset"]
    for name, f in {**PoolConfig.model_fields, **MooncakeConfig.model_fields}.items():
        assert rows[f"`{name}`"][2] == f.description, name


def test_configuration_reference_check_fails_on_a_field_not_rendered():
    """Negative control: a model with one more field (or a changed
    description) no longer matches the committed page."""
    from vllm_layerwise_patch.pool.config import MooncakeConfig, PoolConfig
    from vllm_layerwise_patch.pool.config_doc import reference

    class Grown(PoolConfig):
        new_knob: int = Field(default=3, ge=0, description="a field added without rendering")

    page = _config_section()
    grown = reference(Grown, MooncakeConfig)
    assert grown != page
    assert _fields(grown)[0] == [*PoolConfig.model_fields, "new_knob"] != _fields(page)[0]
    assert "| `new_knob` | integer, ≥ 0 | `3` | a field added without rendering |" in grown

    class Reworded(MooncakeConfig):
        replica_num: int = Field(default=1, ge=1, le=16, description="copies per entry")

    assert reference(PoolConfig, Reworded) != page


def test_readme_is_a_landing_page_and_the_index_lists_every_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 200, "README is the landing page: move detail to docs/"
    index = _prose((ROOT / "docs" / "README.md").read_text())
    linked = {t.partition("#")[0] for t in _LINK.findall(index)}
    pages = {p.name for p in PAGES if p.parent.name == "docs" and p.name != "README.md"}
    assert pages - linked == set(), "docs/README.md does not list these pages"
    assert pages <= {t.partition("#")[0].removeprefix("docs/") for t in _LINK.findall(_prose(readme))}

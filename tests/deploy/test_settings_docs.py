"""docs/DEPLOY.md's settings table and deploy/env.example list every MOE_* setting with its default,
as service.config.Settings defines them (rewrite both: python -m tests.deploy.settings_docs --write)."""

from __future__ import annotations

import re

from service.config import Settings
from tests.deploy import settings_docs
from tests.deploy.settings_docs import DEPLOY_MD, ENV_EXAMPLE, NOTES

FIX = "run `python -m tests.deploy.settings_docs --write` after changing service.config.Settings"


def test_every_setting_has_a_meaning():
    fields = Settings.model_fields
    missing = [name for name in fields if not settings_docs.meaning(name)]
    assert not missing, f"settings without a description (Field(description=...)) or a NOTES entry: {missing}"
    stale = [name for name in NOTES if name not in fields or fields[name].description]
    assert not stale, f"NOTES entries for settings that are gone or now have a description: {stale}"


def test_deploy_md_table_is_current():
    doc = DEPLOY_MD.read_text()
    assert settings_docs.splice_table(doc) == doc, FIX


def test_env_example_is_current():
    assert ENV_EXAMPLE.read_text() == settings_docs.render_env_example(), FIX


def test_env_example_lists_every_setting_with_its_default():
    """Independent of the renderer: parse the file back and compare with Settings."""
    found = dict(re.findall(r"^# (MOE_\w+)=(.*)$", ENV_EXAMPLE.read_text(), flags=re.M))
    expected = {f"MOE_{name.upper()}": "" if f.default is None else str(f.default)
                for name, f in Settings.model_fields.items()}
    assert found == expected
    # Each line, uncommented with its value, is accepted by Settings.
    Settings(**{k[4:].lower(): v for k, v in found.items() if v != ""})


def test_deploy_md_rows_name_every_setting_once():
    rows = re.findall(r"^\| `(MOE_\w+)` \| `(--[\w-]+)` \| ([^|]*) \|", DEPLOY_MD.read_text(), flags=re.M)
    assert [r[0] for r in rows] == [f"MOE_{name.upper()}" for name in Settings.model_fields]

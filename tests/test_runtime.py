"""Profiles, device choice and seeding."""

import pytest
import torch

from transformer_course import runtime


def test_profile_from_environment(monkeypatch):
    monkeypatch.setenv("COURSE_PROFILE", "full")
    assert runtime.get_profile() == "full"
    assert runtime.by_profile(quick=1, full=2) == 2
    monkeypatch.setenv("COURSE_PROFILE", " Quick ")
    assert runtime.get_profile() == "quick"
    assert runtime.by_profile(quick=1, full=2) == 1


def test_default_profile_follows_the_device(monkeypatch):
    monkeypatch.delenv("COURSE_PROFILE", raising=False)
    expected = "full" if torch.cuda.is_available() else "quick"
    assert runtime.get_profile() == expected


def test_unknown_profile_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("COURSE_PROFILE", "fast")
    with pytest.raises(
        ValueError, match=r"COURSE_PROFILE must be one of \('quick', 'full'\), got 'fast'"
    ):
        runtime.get_profile()


def test_seeding_repeats_random_numbers():
    runtime.seed_everything(123)
    first = torch.randn(4), torch.rand(1).item()
    runtime.seed_everything(123)
    assert torch.equal(first[0], torch.randn(4)) and first[1] == torch.rand(1).item()


def test_describe_names_profile_and_device(monkeypatch):
    monkeypatch.setenv("COURSE_PROFILE", "quick")
    assert runtime.describe_run().startswith(f"profile=quick device={runtime.get_device().type}")


def test_show_table_prints_markdown_outside_a_notebook(capsys):
    runtime.show_table(["name", "value"], [["a|b", 1], ["c", 2.5]])
    assert capsys.readouterr().out.splitlines() == [
        "| name | value |",
        "|---|---|",
        "| a\\|b | 1 |",
        "| c | 2.5 |",
    ]
    with pytest.raises(ValueError, match=r"rows\[0\]: expected 2 cells"):
        runtime.show_table(["name", "value"], [["only one"]])

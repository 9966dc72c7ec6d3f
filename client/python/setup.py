"""Build steps pyproject.toml cannot state: the gRPC stubs and the native library.

* fusedps/v1 is generated from proto/fusedps/v1/*.proto into the build: <name>_pb2.py of every
  proto (parameter_service_pb2.py, checkpoint_pb2.py: the checkpoint manifest's message), and
  <name>_pb2_grpc.py of those that declare a service, with protoc and grpc_python_plugin
  (Debian: protobuf-compiler, protobuf-compiler-grpc) or, where those are missing, grpc_tools
  (grpcio-tools). The proto directory is $FUSEDPS_PROTO_DIR, else ../../proto from here (a
  checkout). A source tree that already holds every proto's stubs (the staging directory `make`
  builds the wheel from) is used as it is.
* fusedps/libfusedps_c.so, the native transport (fusedps/_native.py), is shipped when it is in
  the source tree (the wheel `make` builds); the wheel is then tagged for this platform
  (py3-none-<platform>: the library is loaded with ctypes, so any CPython 3 can use it).
"""

import glob
import os
import shutil
import subprocess
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
NATIVE_LIBRARY = os.path.join(HERE, "fusedps", "libfusedps_c.so")


def _proto_dir():
    path = os.environ.get("FUSEDPS_PROTO_DIR") or os.path.join(HERE, "..", "..", "proto")
    if not os.path.isfile(os.path.join(path, "fusedps", "v1", "parameter_service.proto")):
        raise SystemExit(f"fusedps: no proto/fusedps/v1/parameter_service.proto under {path}: "
                         "build from a checkout, or set FUSEDPS_PROTO_DIR")
    return os.path.abspath(path)


def _protos(proto_dir):
    return sorted(glob.glob(os.path.join(proto_dir, "fusedps", "v1", "*.proto")))


def _has_service(proto):
    with open(proto, encoding="utf-8") as f:
        return any(line.startswith("service ") for line in f)


def _generate_stubs(out_dir):
    proto_dir = _proto_dir()
    protos = _protos(proto_dir)
    protoc, plugin = shutil.which("protoc"), shutil.which("grpc_python_plugin")
    if protoc and plugin:
        base = [protoc, f"--plugin=protoc-gen-grpc_python={plugin}"]
    else:
        base = [sys.executable, "-m", "grpc_tools.protoc"]
    base += [f"-I{proto_dir}", f"--python_out={out_dir}"]
    # The gRPC stubs only of the protos with a service (the others' would be empty modules).
    with_service = [p for p in protos if _has_service(p)]
    for batch in (with_service, [p for p in protos if p not in with_service]):
        if batch:
            extra = [f"--grpc_python_out={out_dir}"] if batch is with_service else []
            subprocess.run(base + extra + batch, check=True)
    init = os.path.join(out_dir, "fusedps", "v1", "__init__.py")
    with open(init, "w") as f:
        f.write('"""Generated gRPC stubs of proto/fusedps/v1 (made at build time)."""\n')


def _has_stubs():
    """Whether this source tree holds every proto's _pb2.py (the staging tree `make` builds),
    which then ship as they are."""
    stubs = os.path.join(HERE, "fusedps", "v1")
    names = ["parameter_service", "checkpoint"]
    return all(os.path.isfile(os.path.join(stubs, f"{n}_pb2.py")) for n in names)


class BuildPyWithStubs(build_py):
    def run(self):
        super().run()
        if not _has_stubs():
            _generate_stubs(self.build_lib)


commands = {"build_py": BuildPyWithStubs}
packages = ["fusedps", "fusedps.bench"]
if os.path.isdir(os.path.join(HERE, "fusedps", "v1")):
    packages.append("fusedps.v1")

if os.path.isfile(NATIVE_LIBRARY):
    from wheel.bdist_wheel import bdist_wheel

    class PlatformWheel(bdist_wheel):
        def finalize_options(self):
            super().finalize_options()
            self.root_is_pure = False

        def get_tag(self):
            return ("py3", "none", super().get_tag()[2])

    commands["bdist_wheel"] = PlatformWheel

setup(packages=packages, cmdclass=commands)

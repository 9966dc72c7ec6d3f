"""Build steps pyproject.toml cannot state: the gRPC stubs and the native library.

* fusedps/v1 (parameter_service_pb2*.py) is generated from proto/fusedps/v1/*.proto into the
  build, with protoc and grpc_python_plugin (Debian: protobuf-compiler, protobuf-compiler-grpc)
  or, where those are missing, grpc_tools (grpcio-tools). The proto directory is
  $FUSEDPS_PROTO_DIR, else ../../proto from here (a checkout). A source tree that already holds
  the stubs (the staging directory `make` builds the wheel from) is used as it is.
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


def _generate_stubs(out_dir):
    proto_dir = _proto_dir()
    protos = sorted(glob.glob(os.path.join(proto_dir, "fusedps", "v1", "*.proto")))
    protoc, plugin = shutil.which("protoc"), shutil.which("grpc_python_plugin")
    if protoc and plugin:
        command = [protoc, f"--plugin=protoc-gen-grpc_python={plugin}",
                   f"--grpc_python_out={out_dir}"]
    else:
        command = [sys.executable, "-m", "grpc_tools.protoc", f"--grpc_python_out={out_dir}"]
    command += [f"-I{proto_dir}", f"--python_out={out_dir}"] + protos
    subprocess.run(command, check=True)
    init = os.path.join(out_dir, "fusedps", "v1", "__init__.py")
    with open(init, "w") as f:
        f.write('"""Generated gRPC stubs of proto/fusedps/v1 (made at build time)."""\n')


class BuildPyWithStubs(build_py):
    def run(self):
        super().run()
        if not os.path.isfile(os.path.join(HERE, "fusedps", "v1", "parameter_service_pb2.py")):
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

"""The one compiled part: AES-GCM with VAES for HBONE's record layer (proxy/_aes_gcm_vaes.c).

Everything else about the package is in pyproject.toml. The extension is optional: where it does
not build (no C compiler), proxy/aes_gcm.py uses `cryptography`'s AESGCM and says so.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "ambient_mesh.proxy._aes_gcm_vaes",
            ["ambient_mesh/proxy/_aes_gcm_vaes.c"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            optional=True,
        )
    ]
)

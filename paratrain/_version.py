"""The package version, in a leaf module so that any layer can read it without importing paratrain.

The one source of the version: ``pyproject.toml`` declares it dynamic and setuptools reads this
literal (``[tool.setuptools.dynamic]``, without importing the package), so the wheel's metadata,
``paratrain --version`` and ``paratrain.__version__`` cannot disagree. A release changes this line
and ``CHANGELOG.md``.
"""

__version__ = "0.1.0"

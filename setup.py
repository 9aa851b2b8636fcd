# Only here for the optional native extensions; all metadata lives in pyproject.toml.
from setuptools import setup

setup()

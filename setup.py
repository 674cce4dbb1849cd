"""Package list: the ntp_nemo sources plus the top-level conf/ and recipes/ trees as package data."""

from setuptools import find_packages, setup

setup(packages=find_packages(include=["ntp_nemo", "ntp_nemo.*"]) + ["ntp_nemo.conf", "ntp_nemo.recipes"])

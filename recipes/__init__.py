"""Packaged recipes (installed as ntp_nemo.recipes)."""

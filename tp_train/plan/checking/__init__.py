"""Checking an applied plan: each swapped module, and the whole model, against the unsharded model (`verify`), and
the region modules that swap nothing against themselves unsharded (`region_check`)."""

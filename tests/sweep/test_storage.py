"""Where a study lives: a PostgreSQL URL as the docs write it opens with the driver that is installed."""

from __future__ import annotations

import importlib.util

import pytest

from memfit.sweep.storage import peek, with_installed_driver


def test_a_bare_postgresql_url_takes_the_installed_driver_and_others_stay_as_given():
    driver = "psycopg" if importlib.util.find_spec("psycopg") else "psycopg2"
    assert with_installed_driver("postgresql://me:pw@db:5432/s") == f"postgresql+{driver}://me:pw@db:5432/s"
    assert with_installed_driver("postgres://db/s") == f"postgresql+{driver}://db/s"
    for url in ("postgresql+psycopg2://db/s", "sqlite:////tmp/optuna.db", "mysql://db/s"):
        assert with_installed_driver(url) == url


@pytest.mark.xdist_group("postgres")
def test_a_study_opens_on_a_real_server_from_a_postgresql_url_as_the_docs_write_it(postgres):
    url = postgres("bare_url").replace("postgresql+psycopg2://", "postgresql://")
    storage = peek(url)
    assert storage is None or storage.get_all_studies() == []  # opened: no study there yet

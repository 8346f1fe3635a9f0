"""Alembic's environment for the rollout service's database (pipeline/fleet/db.py
runs it programmatically with an open connection; there is no alembic.ini)."""

from alembic import context

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=None, render_as_batch=connection.dialect.name == "sqlite")
with context.begin_transaction():
    context.run_migrations()

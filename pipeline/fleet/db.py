"""The rollout service's database: SQLite by default, PostgreSQL by URL.

    sqlite:///fleet.db                                   # a file beside the service (the default)
    postgresql+psycopg://user:pass@host:5432/edgekiln    # several service processes behind a load balancer

The schema lives in Alembic migrations (pipeline/fleet/migrations/versions/),
applied at every start (`upgrade head`: a no-op when current), and the tables
are reflected from the database after that: one definition of the schema, the
migrations' history. SQLAlchemy Core, no ORM: each check-in is two or three
statements written out where they run (pipeline/fleet/service.py).

SQLite is opened in WAL mode with a busy timeout, so the service's request
threads read while one writes; a check-in is one short write transaction.
"""

from __future__ import annotations

import datetime as _dt
from pathlib import Path

import sqlalchemy as sa
from alembic import command
from alembic.config import Config

MIGRATIONS = Path(__file__).resolve().parent / "migrations"


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds")


def seconds_since(iso: str) -> float:
    return (_dt.datetime.now(_dt.timezone.utc) - _dt.datetime.fromisoformat(iso)).total_seconds()


def _sqlite_pragmas(dbapi_conn, _record) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: durable across a killed process, the case here
    cur.execute("PRAGMA busy_timeout=30000")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()


def engine_for(url: str) -> sa.Engine:
    if url.startswith("sqlite"):
        eng = sa.create_engine(url, connect_args={"check_same_thread": False, "timeout": 30}, pool_size=8,
                               max_overflow=8, poolclass=sa.pool.QueuePool)
        sa.event.listen(eng, "connect", _sqlite_pragmas)
        return eng
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url[len("postgresql://"):]
    return sa.create_engine(url, pool_size=16, max_overflow=16, pool_pre_ping=True)


def migrate(engine: sa.Engine) -> str:
    """Bring the schema to the newest migration; returns the revision."""
    path = engine.url.database if engine.dialect.name == "sqlite" else None
    if path and path != ":memory:":
        # SQLite's DDL runs outside a transaction here (pysqlite), so two services starting on one file
        # could both create the tables: a lock file beside it lets one migrate first.
        import fcntl

        with open(f"{path}.migrate.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            return _upgrade(engine)
    return _upgrade(engine)


def _upgrade(engine: sa.Engine) -> str:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            # Several service processes starting at once on one database (behind a load balancer): one
            # migrates, the others wait for its transaction and find the schema current.
            conn.execute(sa.text("SELECT pg_advisory_xact_lock(4207431)"))
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")
        return conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalar_one()


class Tables:
    """The schema's tables as the database has them (after migrate)."""

    def __init__(self, engine: sa.Engine):
        md = sa.MetaData()
        md.reflect(engine, only=["devices", "versions", "rollouts", "reports", "decisions"])
        self.devices = md.tables["devices"]
        self.versions = md.tables["versions"]
        self.rollouts = md.tables["rollouts"]
        self.reports = md.tables["reports"]
        self.decisions = md.tables["decisions"]


def open_db(url: str) -> tuple[sa.Engine, Tables, str]:
    engine = engine_for(url)
    rev = migrate(engine)
    return engine, Tables(engine), rev


def upsert(conn: sa.Connection, table: sa.Table, values: dict, keys: list[str], update: list[str]) -> None:
    """INSERT ... ON CONFLICT (keys) DO UPDATE, in each dialect's own words."""
    if conn.dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    stmt = insert(table).values(**values)
    stmt = stmt.on_conflict_do_update(index_elements=keys, set_={k: stmt.excluded[k] for k in update})
    conn.execute(stmt)

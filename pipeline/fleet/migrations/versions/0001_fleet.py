"""The rollout service's first schema: devices, versions, rollouts, reports, decisions.

Revision ID: 0001
Revises:
Create Date: 2026-12-05
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "devices",
        sa.Column("device_id", sa.String(200), primary_key=True),
        sa.Column("device_class", sa.String(100), nullable=False),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("channel", sa.String(50), nullable=False),
        sa.Column("bucket", sa.Float, nullable=False),
        sa.Column("token_sha256", sa.String(64), nullable=False),
        sa.Column("enrolled_at", sa.String(40), nullable=False),
        sa.Column("last_seen", sa.String(40)),
        sa.Column("checkins", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("current_bundle", sa.String(64)),
        sa.Column("assigned_bundle", sa.String(64)),
        sa.Column("health", sa.String(20)),
        sa.Column("health_detail", sa.Text),
        sa.Column("health_at", sa.String(40)),
    )
    op.create_index("ix_devices_token", "devices", ["token_sha256"], unique=True)
    op.create_index("ix_devices_fleet", "devices", ["device_class", "model", "channel", "bucket"])
    op.create_table(
        "versions",
        sa.Column("record_sha256", sa.String(64), primary_key=True),
        sa.Column("bundle_sha256", sa.String(64), nullable=False),
        sa.Column("device_class", sa.String(100), nullable=False),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("version", sa.String(20), nullable=False),
        sa.Column("record", sa.Text, nullable=False),
        sa.Column("added_at", sa.String(40), nullable=False),
    )
    op.create_table(
        "rollouts",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("device_class", sa.String(100), nullable=False),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("channel", sa.String(50), nullable=False),
        sa.Column("target_record", sa.String(64), sa.ForeignKey("versions.record_sha256"), nullable=False),
        sa.Column("baseline_record", sa.String(64), sa.ForeignKey("versions.record_sha256")),
        sa.Column("stages", sa.Text, nullable=False),
        sa.Column("failure_threshold", sa.Float, nullable=False),
        sa.Column("min_reports", sa.Integer, nullable=False),
        sa.Column("success_threshold", sa.Float, nullable=False),
        sa.Column("state", sa.String(20), nullable=False),
        sa.Column("stage", sa.Integer, nullable=False),
        sa.Column("cutoff", sa.Float, nullable=False),
        sa.Column("stage_started_at", sa.String(40), nullable=False),
        sa.Column("created_at", sa.String(40), nullable=False),
        sa.Column("created_by", sa.String(200), nullable=False),
    )
    op.create_index("ix_rollouts_fleet", "rollouts", ["device_class", "model", "channel", "id"])
    op.create_table(
        "reports",
        sa.Column("device_id", sa.String(200), sa.ForeignKey("devices.device_id"), primary_key=True),
        sa.Column("bundle_sha256", sa.String(64), primary_key=True),
        sa.Column("outcome", sa.String(20), nullable=False),
        sa.Column("detail", sa.Text),
        sa.Column("decode_tok_s", sa.Float),
        sa.Column("rolled_back_to", sa.String(64)),
        sa.Column("at", sa.String(40), nullable=False),
    )
    op.create_table(
        "decisions",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("rollout_id", sa.Integer, sa.ForeignKey("rollouts.id"), nullable=False),
        sa.Column("at", sa.String(40), nullable=False),
        sa.Column("action", sa.String(30), nullable=False),
        sa.Column("stage", sa.Integer, nullable=False),
        sa.Column("numbers", sa.Text, nullable=False),
        sa.Column("by", sa.String(200), nullable=False),
        sa.Column("reason", sa.Text),
    )
    op.create_index("ix_decisions_rollout", "decisions", ["rollout_id", "id"])


def downgrade() -> None:
    for t in ("decisions", "reports", "rollouts", "versions", "devices"):
        op.drop_table(t)

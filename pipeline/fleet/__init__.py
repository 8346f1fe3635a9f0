"""Fleets: sweeps of builds in parallel (sweep), builds measured on their device over
SSH (runners), and the artifact registry for rollouts (registry)."""

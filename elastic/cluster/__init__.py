"""Ray clusters: connecting (embedded or an explicit head), the Slurm/LSF bootstrap, the
loopback rendezvous, and a multi-raylet cluster on one machine for tests and benches."""

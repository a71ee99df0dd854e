"""Scale-out: many processes on one host (torchrun) and many hosts (Ray Data)."""

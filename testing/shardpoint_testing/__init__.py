"""What tests, the demo and the conformance suite share to run real multi-process jobs:
the process launcher (and, later, the test cluster)."""

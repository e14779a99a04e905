"""``python -m qedprobe.cli ...`` (as torchrun runs it): the ``qedprobe`` command."""
from qedprobe.cli import main

raise SystemExit(main())

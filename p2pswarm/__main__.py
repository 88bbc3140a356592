"""``python -m p2pswarm`` runs the command line."""

from p2pswarm.cli import main

raise SystemExit(main())

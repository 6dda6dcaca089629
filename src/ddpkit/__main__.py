"""`python -m ddpkit` is the `ddpkit` command."""

from ddpkit.cli import main

raise SystemExit(main())

"""`python -m ddpkit.check PATH...` is `ddpkit check PATH...`."""

from ddpkit.check.command import main

raise SystemExit(main())

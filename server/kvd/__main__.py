from kvd.cli import main

raise SystemExit(main())

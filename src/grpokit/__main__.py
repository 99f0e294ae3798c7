from grpokit.cli.main import main

raise SystemExit(main())

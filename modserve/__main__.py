from modserve.cli import main; raise SystemExit(main())

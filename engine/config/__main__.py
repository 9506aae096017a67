from engine.config.loader import main

raise SystemExit(main())

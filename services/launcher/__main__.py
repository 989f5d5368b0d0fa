"""``python -m services.launcher`` = ``pdserve up``."""

from services.launcher import main

main()

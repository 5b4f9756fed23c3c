from frtools.cli import main

main()

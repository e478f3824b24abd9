from services.kvstore.main import main

main()

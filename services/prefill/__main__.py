from services.prefill.main import main

main()

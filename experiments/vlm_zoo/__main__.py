from experiments.vlm_zoo import main

main()

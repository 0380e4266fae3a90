"""What several test modules share: independent programs that write stage files, case draws,
float32 simulations, shapes, and ways to run or stop the binary. Test modules import from here,
never from each other."""

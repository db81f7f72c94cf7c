"""Multi-token prediction (DeepSeek-V3, Megatron-Core's MultiTokenPredictionBlock): D extra
modules on the last pipeline stage, module k predicting the token k + 1 places ahead from
module k - 1's hidden state and the embedding of the token k places ahead."""

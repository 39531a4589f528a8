// Run an adaptex BudgetFormer package from Swift (iOS 17+ / macOS 14+).
//
//   adaptex export --target coreml -o BudgetFormer.mlpackage      # fp16 body, fp32 routing
//
// Drag BudgetFormer.mlpackage into your Xcode target; Xcode compiles it to .mlmodelc. This file
// uses the generic MLModel API, so it does not depend on the class Xcode generates.
// Output names: Core ML names cannot hold dots, so `decisions.layer0.k` is `decisions_layer0_k`.

import CoreML
import Foundation

struct BudgetFormerResult {
    let classScores: [Float]
    let headsPerLayer: [Int]          // k chosen for each attention layer
    let headMasks: [[Bool]]           // which heads each layer computed
}

final class BudgetFormerClassifier {
    private let model: MLModel
    private let numLayers: Int

    init(compiledModelURL: URL, numLayers: Int = 2, computeUnits: MLComputeUnits = .all) throws {
        let config = MLModelConfiguration()
        config.computeUnits = computeUnits   // .cpuAndNeuralEngine suits the `dense` variant
        model = try MLModel(contentsOf: compiledModelURL, configuration: config)
        self.numLayers = numLayers
    }

    /// tokenIds: one sequence of the model's vocabulary ids (1 ... max_len tokens, no padding).
    func classify(tokenIds: [Int32]) throws -> BudgetFormerResult {
        let length = tokenIds.count
        let shape: [NSNumber] = [1, NSNumber(value: length)]
        let ids = try MLMultiArray(shape: shape, dataType: .int32)
        let mask = try MLMultiArray(shape: shape, dataType: .int32)
        for (i, token) in tokenIds.enumerated() {
            ids[[0, NSNumber(value: i)]] = NSNumber(value: token)
            mask[[0, NSNumber(value: i)]] = 1
        }
        let inputs = try MLDictionaryFeatureProvider(dictionary: [
            "input_ids": MLFeatureValue(multiArray: ids),
            "attention_mask": MLFeatureValue(multiArray: mask),
        ])
        let out = try model.prediction(from: inputs)

        let logits = out.featureValue(for: "logits")!.multiArrayValue!
        let scores = (0..<logits.count).map { logits[$0].floatValue }
        var heads: [Int] = []
        var masks: [[Bool]] = []
        for layer in 0..<numLayers {
            let k = out.featureValue(for: "decisions_layer\(layer)_k")!.multiArrayValue!
            heads.append(k[0].intValue)
            let m = out.featureValue(for: "decisions_layer\(layer)_head_mask")!.multiArrayValue!
            masks.append((0..<m.count).map { m[$0].floatValue > 0.5 })   // 0/1 floats: Core ML has no bool outputs
        }
        return BudgetFormerResult(classScores: scores, headsPerLayer: heads, headMasks: masks)
    }
}
